"""The colocation protocol (loop/phases.py + loop/colocation.py): the order in which the actor and the
engine move, the phase ledger of a real colocated CPU run (actor asleep in generate, engine released in
train, engine weights without KV in sync), and the planner's phases, which read the same phase model.

The engine side is the real EmbeddedEngine (its weights really leave their storage when released); the
protocol-order test uses a recording stand-in for the Megatron actor."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_dapo.loop import phases as phases_mod
from megatron_dapo.loop.colocation import ACTOR_STATE, phase_model
from megatron_dapo.offload import HostOffload, device_bytes
from megatron_dapo.rollout.base import EngineStateError, SamplingParams
from megatron_dapo.rollout.embedded import EmbeddedEngine

REPO = Path(__file__).resolve().parents[1]


class FakeActor:
    """The actor's residency API over real tensors (really offloaded), recording calls."""

    STATE = ACTOR_STATE

    def __init__(self, events: list[str]):
        self.events, self.state = events, {"weights": [torch.ones(1000)], "main_grads": [torch.zeros(1000)],
                                           "optimizer": [torch.ones(2000)]}
        self.offload, self.module, self.spec = HostOffload(), None, None

    def resident(self):
        return tuple(c for c in self.STATE if c not in self.offload.offloaded_groups)

    @property
    def asleep(self) -> bool:
        return not self.resident()

    def sleep(self, parts=ACTOR_STATE):
        if parts := tuple(c for c in parts if c in self.resident()):
            self.events.append(f"actor.sleep {','.join(parts)}")
            self.offload.offload(self.state, drop=("main_grads",), only=parts)

    def wake(self, parts=ACTOR_STATE):
        if parts := tuple(c for c in parts if c not in self.resident()):
            self.events.append(f"actor.wake {','.join(parts)}")
            self.offload.reload(only=parts)

    def device_bytes(self):
        return device_bytes(self.state, torch.device("cpu"))


class RecordingEngine(EmbeddedEngine):
    def __init__(self, model, events):
        super().__init__(model)
        self.events = events

    def sleep(self, tags=None):
        self.events.append(f"engine.sleep {tags}")
        super().sleep(tags)

    def wake(self, tags=None):
        self.events.append(f"engine.wake {tags}")
        super().wake(tags)


def test_phase_model_table():
    m = phase_model(colocate=True, offload_when_idle=True)
    assert list(m) == ["generate", "train", "sync"]
    assert m["generate"].actor == () and m["generate"].engine == ("weights", "kv_cache")
    assert m["train"].actor == ACTOR_STATE and m["train"].engine == () and m["train"].actor_transient
    assert m["sync"].actor == ("weights",) and m["sync"].engine == ("weights",)  # weights only, both sides
    resident = phase_model(colocate=True, offload_when_idle=False)
    assert resident["generate"].actor == resident["sync"].actor == ACTOR_STATE
    separate = phase_model(colocate=False, offload_when_idle=True)
    assert separate["generate"].actor == ACTOR_STATE and all(not p.engine for p in separate.values())


def test_protocol_order_and_ledger(monkeypatch):
    from megatron_dapo.tiny import tiny_model

    events: list[str] = []
    engine = RecordingEngine(tiny_model("qwen2", seed=0), events)
    weights = sum(p.numel() * 4 for p in engine.model.parameters())  # tied: counted once
    saved = [(n, t.detach().clone()) for n, t in engine.model.named_parameters()]

    def stream(module, spec, eng):  # released weights come back lost (NaN): the sync writes every one again
        events.append(f"stream (engine weights {eng.resident_bytes()['weights']})")
        eng.update_weights(saved)
        return phases_mod.SyncStats()

    monkeypatch.setattr(phases_mod, "sync_weights", stream)
    p = phases_mod.Phases(FakeActor(events), engine, colocate=True, offload_when_idle=True)  # type: ignore[arg-type]

    everything = "weights,main_grads,optimizer"
    p.generate()
    assert events == [f"actor.sleep {everything}", "engine.wake None"]  # from all-resident: the actor leaves
    assert p.actor.asleep and engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2, seed=0))
    events.clear()
    p.train()
    assert events == ["engine.sleep None", f"actor.wake {everything}"]  # the engine leaves first
    with pytest.raises(EngineStateError, match="asleep"):
        engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2))
    events.clear()
    p.sync(1)
    # the actor keeps only its weights, the engine's weights come back without the KV cache and are streamed
    # into; then the actor's weights leave before the KV cache returns
    assert events == ["engine.sleep ['kv_cache']", "actor.sleep main_grads,optimizer", "engine.wake ('weights',)",
                      f"stream (engine weights {weights})", "actor.sleep weights", "engine.wake None"]
    led = p.ledger
    assert led["memory/actor_bytes_generate"] == 0 and led["memory/actor_asleep_in_generate"] == 1.0
    assert led["memory/actor_bytes_train"] == 4 * 4000 and led["memory/actor_bytes_sync"] == 4 * 1000
    assert led["memory/engine_bytes_train"] == 0
    assert led["memory/engine_bytes_sync"] == led["memory/engine_bytes_generate"] == weights
    assert engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2, seed=0))


class SlowEngine(EmbeddedEngine):
    """Releases and retakes its memory slowly (a large SGLang server takes seconds): without the ranks
    waiting for each other, the other ranks' actors would move inside that window."""

    def sleep(self, tags=None):
        time.sleep(1.5)
        super().sleep(tags)

    def wake(self, tags=None):
        time.sleep(1.5)
        super().wake(tags)


def _ordered_rank(rank, world, port, out_dir):
    import os

    import torch.distributed as dist

    from megatron_dapo.tiny import tiny_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    phases_mod.sync_weights = lambda module, spec, eng: phases_mod.SyncStats()  # type: ignore[assignment,misc]
    engine = SlowEngine(tiny_model("qwen2", seed=0)) if rank == 0 else None
    p = phases_mod.Phases(FakeActor([]), engine, colocate=True, offload_when_idle=True)  # type: ignore[arg-type]
    p.generate()
    p.train()
    p.sync(1)
    torch.save(list(p.transitions), Path(out_dir) / f"rank_{rank}.pt")
    dist.destroy_process_group()


def test_no_rank_takes_memory_before_every_rank_released_it(tmp_path):
    """On one clock (CLOCK_MONOTONIC): every actor wakes after the driver's engine release returned, and the
    engine's KV cache comes back only after every actor slept (generate after train, and after the sync)."""
    from spawn import run_ranks

    run_ranks(_ordered_rank, str(tmp_path), nprocs=2, timeout_s=120)
    events = {r: torch.load(tmp_path / f"rank_{r}.pt") for r in (0, 1)}

    def times(rank, event):
        return [t for t, e in events[rank] if e == event]

    released = times(0, "engine_released weights,kv_cache")  # train: the engine gives everything back
    resumed = times(0, "engine_resuming weights,kv_cache")  # generate: the KV cache comes back
    assert len(released) == 1 and len(resumed) == 2
    for rank in (0, 1):
        woke = times(rank, "actor_waking weights,main_grads,optimizer")  # train
        slept = [times(rank, f"actor_slept {c}")[0] for c in ("weights,main_grads,optimizer", "weights")]
        assert len(woke) == 1, events[rank]
        assert woke[0] >= released[0], (rank, woke, released)
        assert resumed[0] >= slept[0] and resumed[1] >= slept[1], (rank, resumed, slept)


def test_offload_really_frees_and_restores_values():
    a = torch.arange(10.0)
    view = a[2:5]  # a view of the same storage keeps working after the round trip
    grads = torch.full((4,), 7.0)
    off = HostOffload()
    assert off.offload({"w": [a, view], "g": [grads]}, drop=("g",)) == 40 + 16
    assert a.untyped_storage().nbytes() == 0 and device_bytes({"w": [a]}, a.device) == {"w": 0}
    with pytest.raises(RuntimeError, match="already offloaded"):
        off.offload({"w": [a]})
    off.reload()
    assert torch.equal(a, torch.arange(10.0)) and torch.equal(view, torch.tensor([2.0, 3.0, 4.0]))
    assert not grads.any()  # dropped: zeros on reload


def test_embedded_engine_tags():
    from megatron_dapo.tiny import tiny_model

    engine = EmbeddedEngine(tiny_model("qwen2", seed=0), weights_backup=True)
    full = engine.resident_bytes()
    engine.sleep(["kv_cache"])
    assert engine.resident_bytes() == full  # the KV cache is only held inside generate()
    engine.sleep()
    assert engine.resident_bytes() == {"weights": 0, "kv_cache": 0}
    with pytest.raises(EngineStateError, match="released"):
        engine.update_weights([("model.norm.weight", torch.ones(64))])
    engine.wake(["weights"])
    engine.update_weights([("model.norm.weight", torch.full((64,), 2.0))])
    with pytest.raises(EngineStateError, match="kv_cache released"):
        engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2))
    engine.wake()
    assert torch.equal(engine.model.model.norm.weight, torch.full((64,), 2.0))
    with pytest.raises(ValueError, match="unknown memory tags"):
        engine.sleep(["cuda_graph"])


# ----------------------------------------------------------------------------- a real colocated run


SMALL = ["train.prompt_batch_size=8", "train.mini_batch_size=4", "algo.group_size=4", "eval.every_steps=0",
         "algo.filter_metric=score", "checkpoint.save_every=0", "checkpoint.export_hf=false",
         "data.val_path=", "train.deterministic=true"]


def run_tiny(base_dir: Path, root: Path, run: str, env: dict, *extra: str) -> dict[str, dict[int, float]]:
    from megatron_dapo.metrics import read_scalars

    cmd = [sys.executable, "-m", "megatron_dapo.train", "--config", str(REPO / "examples/configs/tiny_cpu.yaml"),
           f"model.hf_dir={base_dir}", f"checkpoint.dir={root / 'ckpt'}", f"logging.tensorboard_dir={root / 'tb'}",
           f"logging.run_name={run}", *SMALL, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-6000:]
    return read_scalars(root / "tb" / run)


def planned(base_dir: Path, *overrides: str):
    from megatron_dapo import plan as P
    from megatron_dapo.config import load_config

    cfg = load_config(REPO / "examples/configs/tiny_cpu.yaml", [f"model.hf_dir={base_dir}", *SMALL, *overrides])
    return P.make_plan(cfg, P.resolve_model(cfg)[0], P.Hardware(nodes=1, gpus_per_node=1))


def test_colocated_run_ledger_matches_the_plan(base_dir, tmp_path, python_env):
    tb = run_tiny(base_dir, tmp_path, "ledger", python_env, "train.steps=2")
    last = {tag: values[2] for tag, values in tb.items() if 2 in values}
    assert last["memory/actor_asleep_in_generate"] == 1.0
    assert last["memory/actor_bytes_generate"] == 0
    assert last["memory/engine_bytes_train"] == 0  # released while the actor trains
    assert 0 < last["memory/engine_bytes_sync"] <= last["memory/engine_bytes_generate"]
    assert 0 < last["memory/actor_bytes_sync"] < last["memory/actor_bytes_train"]  # sync: the weights only
    plan = planned(base_dir)
    for name in ("generate", "train", "sync"):  # the actor's state, as the planner sized it per phase
        state = sum(v for c, v in plan.phase(name).actor.items() if c in ACTOR_STATE)
        assert last[f"memory/actor_bytes_{name}"] == pytest.approx(state, rel=0.01, abs=1), name
    assert all(math.isfinite(v) for v in last.values())


def test_actor_stays_when_not_offloaded(base_dir, tmp_path, python_env):
    tb = run_tiny(base_dir, tmp_path, "resident", python_env, "train.steps=1", "actor.offload_when_idle=false")
    assert tb["memory/actor_asleep_in_generate"][1] == 0.0
    assert tb["memory/actor_bytes_generate"][1] == tb["memory/actor_bytes_sync"][1] > 0
    plan = planned(base_dir, "actor.offload_when_idle=false")
    assert set(plan.phase("generate").actor) == set(ACTOR_STATE)
