"""CUDA-only: the Transformer Engine layer spec in bf16 against the local spec in fp32 (same HF weights)."""

import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

SCRIPT = r"""
import sys, torch
sys.path.insert(0, "tests/workers")
from actor_worker import fixed_batch, make_cfg
from megatron_dapo import parallel
from megatron_dapo.actor.actor import Actor
hf_dir, out = sys.argv[1], sys.argv[2]
cfg = make_cfg(1, 1)
parallel.initialize(cfg.parallel, seed=7)
res = {}
for name, impl, dtype in [("local", "local", "float32"), ("te", "transformer_engine", "bfloat16")]:
    cfg.model.transformer_impl, cfg.model.dtype = impl, dtype
    actor = Actor.from_hf(hf_dir, cfg.model, cfg.parallel, cfg.actor)
    b = fixed_batch()
    res[name] = actor.compute_logprobs(b)
    b.old_logprobs = res[name][0]
    res[name + "_metrics"] = actor.train_step(b)
    actor.sleep(); actor.wake()
    res[name + "_after_wake"] = actor.compute_logprobs(b)[0]
torch.save(res, out)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_te_bf16_logprobs_match_local_fp32(tmp_path, python_env):
    pytest.importorskip("transformer_engine")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path / "hf")
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "hf"), str(tmp_path / "out.pt")],
                       capture_output=True, text=True, env=python_env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    res = torch.load(tmp_path / "out.pt")
    valid = torch.arange(16)[None, 1:] < torch.tensor([16, 11, 9, 16, 6, 13, 8, 12])[:, None]
    diff = (res["te"][0][:, 1:] - res["local"][0][:, 1:])[valid].abs()
    assert diff.mean() < 0.05 and diff.max() < 0.3  # bf16 weights and activations
    assert res["te_metrics"]["update_ok"] == 1.0
    assert torch.isfinite(res["te_after_wake"]).all()
