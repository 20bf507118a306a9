"""CUDA-only: the phase ledger against real CUDA memory. A bf16 Megatron actor and an in-process engine
share one GPU; torch.cuda.memory_allocated moves between phases by what the ledger says each side
took or gave back (the ledger counts tensors it owns; CUDA counts every allocation)."""

import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SCRIPT = r"""
import json, sys, torch
from megatron_dapo import parallel
from megatron_dapo.actor.actor import Actor
from megatron_dapo.config import Config
from megatron_dapo.loop.phases import Phases
from megatron_dapo.rollout.embedded import EmbeddedEngine
from megatron_dapo.types import TrainBatch

hf_dir, out = sys.argv[1], sys.argv[2]
cfg = Config()
cfg.model.dtype, cfg.model.transformer_impl = "bfloat16", "local"
parallel.initialize(cfg.parallel, seed=0)
actor = Actor.from_hf(hf_dir, cfg.model, cfg.parallel, cfg.actor)
engine = EmbeddedEngine(hf_dir, device="cuda", dtype=torch.bfloat16)
phases = Phases(actor, engine, colocate=True, offload_when_idle=True)
ids = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(0))
batch = TrainBatch(input_ids=ids, loss_mask=torch.ones(2, 64), lengths=torch.full((2,), 64),
                   advantages=torch.tensor([1.0, -1.0]))
phases.train()
batch.old_logprobs = actor.compute_logprobs(batch)[0]
actor.train_step(batch)  # the optimizer state exists from here on
before = actor.compute_logprobs(batch)[0]
res = {}
for name in ("generate", "train", "sync"):
    getattr(phases, name)()
    torch.cuda.synchronize()
    res[name] = {"allocated": torch.cuda.memory_allocated(), **phases.ledger}
phases.train()
res["logprobs_after_round_trip"] = (actor.compute_logprobs(batch)[0] - before).abs().max().item()
json.dump(res, open(out, "w"))
"""


def test_ledger_matches_cuda_memory(tmp_path, python_env):
    from megatron_dapo.tiny import save_tiny_model

    hf = save_tiny_model(tmp_path / "hf", "qwen2", seed=0, vocab_size=32000, hidden_size=256,
                         intermediate_size=768, num_hidden_layers=4, num_attention_heads=4)
    out = tmp_path / "res.json"
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(hf), str(out)], capture_output=True, text=True,
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
