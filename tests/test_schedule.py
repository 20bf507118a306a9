"""The schedule of rollout.async_steps = k in one object (issue 39 item 1): which weights each batch is collected
on, when the step's weights move (a sync, or a snapshot for the producer), the wait at the batch boundary, the
evaluation's settle, staleness; the synchronous loop is k = 0. Hand-written expectations from pipeline.py's rule:
batch b is generated from the weights after step b - 1 - k (or the engine's, if later)."""

from types import SimpleNamespace

import pytest

from megatron_dapo.algo.dynamic_sampling import DynamicSamplingStats
from megatron_dapo.collect.result import StepRollout
from megatron_dapo.config import RolloutConfig
from megatron_dapo.metrics import PhaseTimer
from megatron_dapo.schedule import Schedule
from megatron_dapo.schedule.pipeline import WeightSnapshot
from megatron_dapo.types import Group, Prompt, Sample


def prompt(uid: str) -> Prompt:
    return Prompt(uid=uid, messages=({"role": "user", "content": "q"},), ground_truth="1")


def sample(version: int) -> Sample:
    return Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[-1.0], finish_reason="stop",
                  versions=[(0, version)])


class Weights:
    """Phases' weight moves, recorded: 'sync s', 'snapshot s' (due or not), 'take s' (the producer's)."""

    def __init__(self):
        self.step, self.calls = 0, []

    def sync(self, step):
        self.step = step
        self.calls.append(f"sync {step}")
        return SimpleNamespace(scalars=dict)

    def snapshot(self, step, due=True):
        self.step = step
        self.calls.append(f"snapshot {step}" + ("" if due else " (not due)"))
        return SimpleNamespace(scalars=dict), WeightSnapshot(step) if due else None

    def take_snapshot(self, snap):
        self.calls.append(f"take {snap.version}")


def schedule_of(k: int, mode: str = "batch", steps: int = 6):
    weights, made = Weights(), []

    def collect(step, version, live):
        made.append((step, version, live is not None))
        return StepRollout([Group(prompt(str(step)), [sample(version)])],
                           DynamicSamplingStats(1, 1, 1, 1.0, False), [])

    cfg = RolloutConfig(async_steps=k, async_mode="stream" if mode == "stream" else "batch", colocate=k == 0)
    schedule = Schedule(cfg, steps, weights, collect, PhaseTimer(), SimpleNamespace(last_update=None),  # type: ignore[arg-type]
                        "model.hf_dir=x", threads=1)
    return schedule, weights, made


def run_steps(schedule: Schedule, steps: int, evaluate_after=()):
    for step in range(1, steps + 1):
        schedule.rollout(step)
        schedule.boundary()
        schedule.publish(step)
        if step in evaluate_after:
            schedule.settle(step)
    schedule.close()


def test_k0_is_the_synchronous_loop():
    schedule, weights, made = schedule_of(0)
    assert schedule.pipeline is None and not schedule.lagged
    run_steps(schedule, 3, evaluate_after=(2,))
    assert made == [(1, 0, False), (2, 1, False), (3, 2, False)]  # batch s on the weights after s - 1
    assert weights.calls == ["sync 1", "sync 2", "sync 3"]  # no extra sync for the evaluation
    groups, staleness = schedule.fresh([], 3)
    assert staleness == {}


def test_k1_generates_one_batch_ahead_and_syncs_at_the_boundary():
    schedule, weights, made = schedule_of(1, steps=4)
    run_steps(schedule, 4)
    assert sorted(made) == [(1, 0, False), (2, 0, False), (3, 1, False), (4, 2, False)]
    assert weights.calls == ["sync 1", "sync 2", "sync 3", "sync 4"]


@pytest.mark.parametrize("k, mode", [(2, "batch"), (1, "stream")])
def test_lagged_schedules_hand_snapshots_to_the_producer_and_settle_before_an_evaluation(k, mode):
    schedule, weights, made = schedule_of(k, mode, steps=5)
    assert schedule.lagged
    run_steps(schedule, 5, evaluate_after=(3,))
    due = [v for s, v, _ in sorted(made)]
    assert all(v >= max(s - 1 - k, 0) for (s, _, _), v in zip(sorted(made), due))  # at most k versions old
    assert all(live == (mode == "stream") for _, _, live in made)
    snapshots = [c for c in weights.calls if c.startswith("snapshot")]
    ahead = 0 if mode == "stream" else k  # the last steps' weights are due no batch: nothing is copied
    assert snapshots == [f"snapshot {s}" + ("" if s + 1 + ahead <= 5 else " (not due)") for s in range(1, 6)]
    assert "sync 3" in weights.calls  # the evaluation after step 3 scores exactly those weights


def test_staleness_drops_what_is_older_than_k():
    schedule, _, _ = schedule_of(1)
    old = Group(prompt("a"),
                [sample(0)])
    new = Group(prompt("b"),
                [sample(3)])
    kept, scalars = schedule.fresh([old, new], 5)  # the actor has made 4 updates
    schedule.close()
    assert kept == [new] and scalars["rollout/dropped_stale_groups"] == 1.0
