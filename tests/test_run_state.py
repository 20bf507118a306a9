"""RunState's parts (issue 39 item 5): registered once, the schedule's pending batches saved first and loaded last; a part an
older checkpoint lacks starts afresh; a carry is dropped without partial rollout."""

import json
from types import SimpleNamespace
from typing import Any

import pytest

from megatron_dapo.config import Config
from megatron_dapo.loop import state as run_state
from megatron_dapo.metrics import Alarms
from megatron_dapo.rollout.restarts import Restarts
from megatron_dapo.collect.carry import PartialCarry


class Part:
    def __init__(self, value=None):
        self.value = value

    def state_dict(self):
        return self.value

    def load_state_dict(self, state):
        self.value = state


class Pipeline:
    """Like a pipelined Schedule: its state_dict finishes a batch in production, which counts its samples."""

    def __init__(self, run=None, pending=None):
        self.run, self.pending, self.version = run, pending, None

    def state_dict(self):
        self.run.samples_generated += 8
        return self.pending

    def load_state_dict(self, state, step):
        self.pending, self.version = state, step


def new_run(cfg: Config, **kw) -> Any:
    """A RunState of stand-ins (Any: they are not the real parts' types)."""
    stub: Any = SimpleNamespace(train=lambda: None, load_history=lambda step: None)
    kw.setdefault("schedule", Pipeline())
    return run_state.RunState(cfg=cfg, actor=None, tokenizer=None, engine=None, phases=stub, prompts=Part(),  # type: ignore[arg-type]
                              val_prompts=[], writer=stub, alarms=Alarms(cfg.logging, 16), ckpt_root=None,
                              hf_dir="", scorer=None, old_logprobs=None, **kw)


@pytest.fixture
def checkpoint(monkeypatch):
    saved: dict = {}

    def save(actor, root, step, trainer_state, **kw):
        saved.update(step=step, trainer=json.loads(json.dumps(trainer_state)))

    monkeypatch.setattr(run_state, "save_checkpoint", save)
    monkeypatch.setattr(run_state, "load_checkpoint", lambda actor, path, verify: json.loads(json.dumps(saved)))
    return saved


@pytest.mark.parametrize("partial", [True, False])
def test_the_parts_round_trip_and_the_pipeline_saves_first(checkpoint, partial):
    cfg = Config()
    cfg.rollout.partial_rollout = partial
    run = new_run(cfg, restarts=Restarts(3, engine_restarts=2, resubmitted_groups=5), samples_generated=40)
    run.schedule = Pipeline(run, pending={"step": 7})
    run.prompts.value = {"epoch": 1, "index": 3}
    run.carry.groups = []
    run.alarms.raised.add("entropy_collapse")
    run.save(6)
    assert checkpoint["trainer"]["samples_generated"] == 48  # counted after the pipeline finished its batch
    assert list(checkpoint["trainer"])[0] == "pending"

    back = new_run(cfg, restarts=Restarts(3))
    back.schedule = Pipeline()
    back.resume("ckpt")
    assert (back.start_step, back.samples_generated, back.prompts.value) == (6, 48, {"epoch": 1, "index": 3})
    assert (back.schedule.pending, back.schedule.version) == ({"step": 7}, 6)
    assert back.restarts.state_dict() == {"engine_restarts": 2, "resubmitted_groups": 5}
    assert back.alarms.state_dict() == run.alarms.state_dict()


def test_an_older_checkpoint_resumes_and_a_carry_without_partial_rollout_is_dropped(checkpoint):
    checkpoint.update(step=3, trainer={"data": {"index": 1}, "alarms": {}, "samples_generated": 24, "config": {},
                                        "carry": PartialCarry().state_dict() + [{"unreadable": True}],
                                        "pending": None})  # before the restarts part existed
    back = new_run(Config(), restarts=Restarts(3))
    back.schedule = Pipeline(pending={"stale": True})
    back.resume("ckpt")
    assert (back.samples_generated, back.prompts.value, back.carry.groups) == (24, {"index": 1}, [])
    assert back.restarts.state_dict() == {"engine_restarts": 0, "resubmitted_groups": 0}
    assert (back.schedule.pending, back.schedule.version) == (None, 3)
