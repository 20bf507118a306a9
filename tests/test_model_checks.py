"""Fail early on layouts that cannot work and size micro-batches from the
vocabulary: validate() reads the model's config.json and refuses a TP that does not divide the
heads / KV heads / MLP width (naming the valid TP values) or a PP that does not divide the layers,
before any process group; overrides may come before or after flags."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_dapo.config import ConfigError, load_config, validate
from megatron_dapo.config.model_checks import valid_tp_sizes
from megatron_dapo.config.sizing import auto_tokens, resolve_micro_batches

REPO = Path(__file__).resolve().parents[1]
CFG = str(REPO / "examples/configs/tiny_cpu.yaml")


@pytest.fixture(scope="module")
def nine_heads(tmp_path_factory):
    """SmolLM-135M's attention shape: 9 heads, 3 KV heads, MLP 1536 (tiny otherwise), 30 -> 6 layers."""
    from megatron_dapo.tiny import save_tiny_model
    from megatron_dapo.tiny.tokenizer import build_char_tokenizer, save_tokenizer

    path = save_tiny_model(tmp_path_factory.mktemp("nine"), "llama", hidden_size=72, num_attention_heads=9,
                           num_key_value_heads=3, intermediate_size=1536, num_hidden_layers=6)
    save_tokenizer(build_char_tokenizer(), path)  # --dry-run loads it
    return path


def test_valid_tp_values_are_the_common_divisors():
    assert valid_tp_sizes({"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}) == [1, 3]
    assert valid_tp_sizes({"num_attention_heads": 40, "num_key_value_heads": 8, "intermediate_size": 27648}) == \
        [1, 2, 4, 8]  # Qwen2.5-32B


@pytest.mark.parametrize("overrides, fragments", [
    (["parallel.tensor_parallel=2"], ["parallel.tensor_parallel=2 does not divide num_attention_heads=9",
                                      "num_key_value_heads=3", "valid TP sizes: 1, 3"]),
    (["parallel.pipeline_parallel=4"], ["parallel.pipeline_parallel=4 does not divide num_hidden_layers=6",
                                        "valid PP sizes: 1, 2, 3, 6"]),
    (["rollout.engine=sglang", "rollout.sglang.tensor_parallel=2"], ["rollout.sglang.tensor_parallel=2"]),
])
def test_layouts_the_model_cannot_take(nine_heads, overrides, fragments):
    cfg = load_config(CFG, [f"model.hf_dir={nine_heads}", *overrides])  # no world size yet: fine
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=4)
    for fragment in fragments:
        assert fragment in str(e.value)


def test_layouts_the_model_can_take(nine_heads):
    validate(load_config(CFG, [f"model.hf_dir={nine_heads}", "parallel.tensor_parallel=3"]), world_size=3)
    validate(load_config(CFG, [f"model.hf_dir={nine_heads}", "parallel.pipeline_parallel=2"]), world_size=2)
    validate(load_config(CFG, ["model.hf_dir=/nowhere", "parallel.tensor_parallel=2"]), world_size=2)  # no config.json


def test_dry_run_refuses_tp2_on_nine_heads_before_any_process_group(nine_heads, python_env):
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "megatron_dapo.train", "--config", CFG, f"model.hf_dir={nine_heads}",
                        "--dry-run", "parallel.tensor_parallel=2", "--world-size", "2"],
                       capture_output=True, text=True, env=python_env, timeout=120)
    assert r.returncode == 2 and "valid TP sizes: 1, 3" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert time.time() - t0 < 60


def test_overrides_before_and_after_flags(nine_heads, python_env):
    r = subprocess.run([sys.executable, "-m", "megatron_dapo.train", "--config", CFG, f"model.hf_dir={nine_heads}",
                        "--dry-run", "train.steps=3"], capture_output=True, text=True, env=python_env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "steps: 3" in r.stdout and f"hf_dir: {nine_heads}" in r.stdout
    r = subprocess.run([sys.executable, "-m", "megatron_dapo.config", "algo.eps_high=0.3", "--config", CFG,
                        "--print", "train.steps=5"], capture_output=True, text=True, env=python_env, timeout=120)
    assert r.returncode == 0 and "eps_high: 0.3" in r.stdout and "steps: 5" in r.stdout, r.stderr


def test_micro_batches_from_the_vocabulary():
    # fp32 logits of one micro-batch within 256 MiB on CPU: tokens x padded vocab x 4 B
    assert auto_tokens(100, 1, on_gpu=False) == 16384  # 128 columns: capped
    assert auto_tokens(49152, 1, on_gpu=False) == 1024  # 2**28 / (49152 * 4) = 1365 -> 1024
    assert auto_tokens(49152, 1, on_gpu=False, logprob=True) == 2048
    assert auto_tokens(152064, 1, on_gpu=False) == 256  # 441 -> 256 (the floor)
    assert auto_tokens(152064, 8, on_gpu=True) == 16384  # 2 GiB / (19072 * 4) = 28146 -> capped
    assert auto_tokens(152064, 8, on_gpu=True, logprob=True) == 32768
    cfg = load_config(None, ["actor.logprob_micro_batch_tokens=999"])
    assert (cfg.actor.micro_batch_tokens, cfg.actor.logprob_micro_batch_tokens) == (0, 999)  # 0 = auto
    resolved = resolve_micro_batches(cfg.actor, 49152, 1, on_gpu=False)
    assert (resolved.micro_batch_tokens, resolved.logprob_micro_batch_tokens) == (1024, 999)
    with pytest.raises(ConfigError, match="micro_batch_tokens"):
        load_config(None, ["actor.micro_batch_tokens=-1"])
