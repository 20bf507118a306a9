"""Actor -> embedded engine weight sync at TP1 / TP2 / PP2: after a sync the engine's logprobs of its
own samples equal the (trained) actor's teacher-forced logprobs."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_dapo.parallel import free_port
from megatron_dapo.tiny import save_tiny_model

WORKER = Path(__file__).parent / "workers" / "sync_worker.py"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("hf"), "qwen2", vocab_size=200, max_position_embeddings=128,
                           eos_token_id=199)


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama", tied=True, vocab_size=200,
                           max_position_embeddings=128, eos_token_id=199)


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_engine_matches_actor_after_sync(hf_dir, tmp_path, python_env, tp, pp):
    res = run_sync(hf_dir, tmp_path, python_env, tp, pp)
    assert res["tensors"] == 2 * 12 + 3  # 12 HF tensors per layer (qkv biases), embeddings, norm, lm_head


def test_tied_embeddings_across_pipeline_stages(tied_llama_dir, tmp_path, python_env):
    """PP=2 with tied embeddings: the last stage's copy of the embedding loads, trains and is not exported twice."""
    res = run_sync(tied_llama_dir, tmp_path, python_env, 1, 2)
    assert res["tensors"] == 2 * 9 + 2  # no biases, no lm_head


def run_sync(hf_dir, tmp_path, python_env, tp, pp):
    out = tmp_path / "out.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(tp * pp), "--master_port",
           str(free_port()), str(WORKER), str(hf_dir), str(out), str(tp), str(pp)]
    env = {**python_env, "PYTHONPATH": f"{WORKER.parent}:{python_env['PYTHONPATH']}"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-5000:]
    res = torch.load(out)
    assert res["mean_abs_diff"] < 1e-5 and res["max_abs_diff"] < 1e-4, res
    assert res["stale_mean_abs_diff"] > 1e-3  # before the sync the engine really was behind the actor
    return res

