"""CUDA-only: the phase ledger against real CUDA memory. A bf16 Megatron actor and an in-process engine
share one GPU; torch.cuda.memory_allocated moves between phases by what the ledger says each side
took or gave back (the ledger counts tensors it owns; CUDA counts every allocation)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

WORKER = Path(__file__).parent / "workers" / "phases_gpu_worker.py"


def test_ledger_matches_cuda_memory(tmp_path, python_env):
    from megatron_dapo.tiny import save_tiny_model

    hf = save_tiny_model(tmp_path / "hf", "qwen2", seed=0, vocab_size=32000, hidden_size=256,
                         intermediate_size=768, num_hidden_layers=4, num_attention_heads=4)
    out = tmp_path / "res.json"
    r = subprocess.run([sys.executable, str(WORKER), str(hf), str(out)], capture_output=True, text=True,
                       env=python_env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    import json

    res = json.loads(out.read_text())
    gen, train = res["generate"], res["train"]
    led = res["sync"]  # the ledger holds every phase's values by now
    assert led["memory/actor_asleep_in_generate"] == 1.0 and led["memory/actor_bytes_generate"] == 0
    assert led["memory/engine_bytes_train"] == 0
    actor, engine = led["memory/actor_bytes_train"], led["memory/engine_bytes_generate"]
    assert actor > 50e6 and engine > 10e6
    # generate -> train: the engine's weights leave, the actor's state comes back
    moved = train["allocated"] - gen["allocated"]
    assert moved == pytest.approx(actor - engine, rel=0.02, abs=4 << 20)
    assert led["memory/device_allocated_train"] == train["allocated"]
    assert led["memory/engine_bytes_sync"] == engine  # weights only (the embedded KV lives in generate())
    assert res["logprobs_after_round_trip"] == 0.0  # sleeping and waking kept the weights bit for bit
