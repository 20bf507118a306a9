"""The embedded engine on the actor's own parameters: one copy of the weights in one
process. The model built on them equals transformers loading the folder; every tensor except the fused
QKV aliases the actor, follows its updates without a sync, and a sync makes the engine exact again."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).parent / "workers" / "shared_worker.py"


def qkv_numel(hidden, heads, kv_heads, layers, bias):
    head_dim = hidden // heads
    rows = (heads + 2 * kv_heads) * head_dim
    return layers * rows * (hidden + (1 if bias else 0))


@pytest.mark.parametrize("family, tied", [("qwen2", False), ("llama", True)])
def test_engine_shares_the_actors_weights(tiny_hf, tmp_path, python_env, family, tied):
    hf_dir = tiny_hf(family, tied=tied, vocab_size=200, max_position_embeddings=128, eos_token_id=199)
    out = tmp_path / "out.pt"
    env = {**python_env, "PYTHONPATH": f"{WORKER.parent}:{python_env['PYTHONPATH']}"}
    r = subprocess.run([sys.executable, str(WORKER), str(hf_dir), str(out)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-5000:]
    res = torch.load(out)
    assert res["can_share"]
    assert res["logits_diff"] < 1e-5  # the aliased model is the HF model
    # tiny defaults: hidden 64, 4 heads / 2 KV heads, 2 layers; qwen2 has QKV biases
    assert res["total"] - res["shared"] == qkv_numel(64, 4, 2, 2, bias=family == "qwen2")
    assert res["still_aliased"] == res["aliased"], "aliasing lost after an optimizer step"
    assert res["moved"] == res["aliased"]  # the update reached the engine without a sync, QKV copies did not move
    copies = {"q_proj", "k_proj", "v_proj"}
    assert not any(k in n for n in res["aliased"] for k in copies)
    assert res["stale"] > 1e-4  # QKV is a copy: stale until the sync
    assert res["diff"] < 1e-5 and res["max_diff"] < 1e-4, res
