"""Off-policy pipelining (`rollout.async_steps=1`, schedule/pipeline.py): the fixed k=1 schedule, real overlap,
the recorded policy versions, staleness dropping, the pending batch in checkpoints, exact resume (k=1 and 2),
the config's refusals; the synchronous loop keeps its own (no staleness monitors, no correction by default).
More than one batch ahead: test_pipeline_deep.py."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from support import TAGS, kill_job_at, run_train, train_cmd

from megatron_dapo.algo.dynamic_sampling import DynamicSamplingStats
from megatron_dapo.config import Config, ConfigError, validate
from megatron_dapo.collect.carry import PartialCarry
from megatron_dapo.schedule.pipeline import RolloutPipeline
from megatron_dapo.collect.result import StepRollout, StreamRollout, StreamStats, load_rollout, rollout_state
from megatron_dapo.collect.versions import drop_stale, stamp, staleness_scalars
from megatron_dapo.metrics import read_scalars
from megatron_dapo.rollout.base import GroupRequest, SamplingParams
from megatron_dapo.types import FinishReason, Group, Prompt, Sample

REPO = Path(__file__).resolve().parents[1]
ASYNC = ["rollout.colocate=false", "rollout.async_steps=1"]


def sample(n: int, version: int | None = None, reason: FinishReason = "stop") -> Sample:
    s = Sample(prompt_ids=[1, 2], response_ids=list(range(3, 3 + n)), rollout_logprobs=[-0.5 - i / 7 for i in range(n)],
               finish_reason=reason, response_text="Answer: 1", reward=1.0, acc=True, pred="1")
    if version is not None:
        s.versions = [(0, version)]
    return s


def group(uid: str, *versions: int) -> Group:
    return Group(Prompt(uid, ({"role": "user", "content": uid},), "1"), [sample(2, v) for v in versions])


# --- the schedule -------------------------------------------------------------------------------------------

def test_k1_schedule_each_batch_comes_from_the_weights_after_the_step_before_last():
    """The loop's order (take s, start s+1, train s, wait, sync s) on a pipeline whose batches record the
    engine's weights when they were made: batch b is made from the weights after step max(b - 2, 0)."""
    engine = {"version": 0}
    made: dict[int, int] = {}
    pipe = RolloutPipeline(threads=1)

    def produce(step: int) -> StepRollout:
        made[step] = engine["version"]
        return StepRollout([], None)

    pipe.produce = produce
    for step in range(1, 6):
        pipe.take(step)
        pipe.fill(step, last=5)
        pipe.wait()  # the boundary, before the weights change
        engine["version"] = step  # the step's sync
        pipe.publish(step, None)
    pipe.close()
    assert made == {1: 0, 2: 0, 3: 1, 4: 2, 5: 3}


def test_the_next_batch_is_made_while_this_step_trains():
    """Proof of overlap without a clock: the producer waits for an event the main thread sets only while it
    'trains'; a pipeline that produced in the main thread would never finish (the test would time out)."""
    training = threading.Event()
    pipe = RolloutPipeline(threads=1)

    def produce(step: int) -> StepRollout:
        if step == 2:
            assert training.wait(timeout=30), "batch 2 was not produced while step 1 trained"
        return StepRollout([], None)

    pipe.produce = produce
    pipe.take(1)
    pipe.start(2)
    training.set()  # step 1 "trains"
    pipe.wait()
    assert pipe.take(2) is not None
    timings = pipe.step_scalars()
    assert set(timings) == {"timing/actor_idle_s", "timing/engine_idle_s", "timing/overlap_s"}
    assert all(v >= 0 for v in timings.values())
    pipe.close()


def test_a_producer_error_surfaces_at_the_boundary():
    pipe = RolloutPipeline(threads=1)
    pipe.produce = lambda step: (_ for _ in ()).throw(RuntimeError(f"engine died on batch {step}"))
    pipe.start(2)
    with pytest.raises(RuntimeError, match="engine died on batch 2"):
        pipe.wait()
    pipe.close()


def test_asking_for_another_steps_batch_is_an_error():
    pipe = RolloutPipeline(threads=1)
    pipe.produce = lambda step: StepRollout([], None)
    pipe.publish(1, None)
    pipe.start(3)
    with pytest.raises(RuntimeError, match="holds batch 3, step 2"):
        pipe.take(2)
    pipe.close()


# --- versions, staleness ----------------------------------------------------------------------------------

def test_a_continued_sample_keeps_its_earlier_versions():
    """A sample carried in with 3 tokens of version 4 and continued to 5 tokens by version 6 has two spans;
    a fresh one has one; a carried sample that made no new token keeps its spans."""
    before = sample(3, 4)
    grown, fresh, idle = sample(5), sample(2), sample(3)
    stamp([grown], 6, (before,))
    stamp([fresh], 6)
    stamp([idle], 6, (before,))
    assert grown.versions == [(0, 4), (3, 6)]
    assert fresh.versions == [(0, 6)]
    assert idle.versions == [(0, 4)]


def test_groups_older_than_the_bound_are_dropped_and_counted():
    """At step 7 the actor has made 6 updates; with async_steps=1 a group whose oldest token came from the
    weights after step 4 (2 updates behind) is dropped, one from step 5 is trained (staleness 1)."""
    fresh, old = group("a", 5, 5), group("b", 5, 4)
    kept, dropped = drop_stale([fresh, old], actor_version=6, max_staleness=1)
    assert dropped == 1 and kept == [fresh]
    assert staleness_scalars(kept, 6, dropped) == {"rollout/staleness_mean": 1.0, "rollout/staleness_max": 1.0,
                                                      "rollout/dropped_stale_groups": 1.0}


# --- the pending batch in checkpoints ---------------------------------------------------------------------

def test_a_pending_stream_batch_survives_json_exactly():
    kept, other = group("a", 3, 3), group("b", 3, 3)
    carried = sample(2, 3, reason="abort")
    req = GroupRequest(key=0, prompt_ids=[1, 2], n=1, sampling=SamplingParams(max_new_tokens=8, seed=5),
                       resume=(carried,), carried_steps=1)
    r = StreamRollout(groups=[kept], stats=DynamicSamplingStats(1, 2, 1, 0.5, False), generated=[other, kept],
                      reward_seconds=0.1, generate_seconds=1 / 3, reward_failures=1,
                      stream=StreamStats(submitted=3, aborted_groups=1, first_kept_s=float("nan")),
                      wasted_tokens=0, carry=PartialCarry([(Prompt("c", ({"role": "user", "content": "c"},), "2"), req)]))
    back = load_rollout(json.loads(json.dumps(rollout_state(r))))
    assert isinstance(back, StreamRollout)
    assert back.generated == r.generated and back.groups[0] is back.generated[1]
    assert back.stats == r.stats and back.generate_seconds == r.generate_seconds
    assert back.carry.groups[0][1].resume[0].versions == [(0, 3)] and back.carry == r.carry
    assert back.stream.submitted == 3 and back.stream.first_kept_s != back.stream.first_kept_s  # NaN kept


def test_the_pipeline_saves_the_batch_it_holds():
    pipe = RolloutPipeline(threads=1)
    pipe.produce = lambda step: StepRollout([group("a", 0)], DynamicSamplingStats(1, 1, 1, 1.0, False),
                                           [group("a", 0)])
    pipe.start(2)
    pipe.wait()
    state = json.loads(json.dumps(pipe.state_dict()))
    other = RolloutPipeline(threads=1)
    other.load_state_dict(state)
    assert other.take(2).generated[0].samples[0].versions == [(0, 0)]
    pipe.close()
    other.close()


def test_a_checkpoint_records_the_prompts_after_the_batches_still_in_production(monkeypatch):
    """A save while batch 4 is being generated: the saved prompt position, carry and count are the ones after
    it (the checkpoint holds it), never a mid-batch position read before the drain (a killed k=2 run then
    resumed with batch 5 on other prompts: a CI flake)."""
    from types import SimpleNamespace

    from megatron_dapo.loop import state as state_mod
    from megatron_dapo.rollout.restarts import Restarts

    prompts = SimpleNamespace(position=3)
    prompts.state_dict = lambda: {"position": prompts.position}
    release = threading.Event()

    def produce(step: int) -> StepRollout:
        release.wait(timeout=30)
        prompts.position += 1  # the producer pulls the batch's prompts and leaves groups to carry
        run.carry = SimpleNamespace(state_dict=lambda: [f"aborted in batch {step}"])
        return StepRollout([group("a", 0)], DynamicSamplingStats(1, 1, 1, 1.0, False), [group("a", 0)])

    pipe = RolloutPipeline(threads=1, depth=2, version=2)
    pipe.produce = produce
    pipe.start(4)
    saved = {}
    monkeypatch.setattr(state_mod, "save_checkpoint", lambda *a, trainer_state, **kw: saved.update(trainer_state))
    run: Any = SimpleNamespace(prompts=prompts, alarms=SimpleNamespace(state_dict=dict), samples_generated=0,
                          cfg=Config(), carry=PartialCarry(), schedule=pipe, phases=SimpleNamespace(train=lambda: None),
                          actor=None, ckpt_root=None, hf_dir=None, restarts=Restarts(0))
    run.parts = lambda: state_mod.RunState.parts(run)
    threading.Timer(0.2, release.set).start()
    state_mod.RunState.save(run, 2)
    pipe.close()
    assert saved["pending"]["step"] == 4
    assert saved["data"] == {"position": 4} and saved["carry"] == ["aborted in batch 4"]

def test_the_producer_takes_half_of_the_threads_unless_the_engine_has_its_own():
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        RolloutPipeline(threads=1).close()  # the embedded engine's process has its own: the actor keeps all
        assert torch.get_num_threads() == 4
        pipe = RolloutPipeline()  # SGLang: the producer thread takes half
        assert pipe.threads == 2 and torch.get_num_threads() == 2
        pipe.close()
    finally:
        torch.set_num_threads(before)


# --- config -------------------------------------------------------------------------------------------------

def test_async_needs_its_own_devices_and_a_recomputed_pi_old():
    cfg = Config()
    cfg.rollout.async_steps = 1
    with pytest.raises(ConfigError, match=r"async_steps=1 overlaps .* set rollout.colocate=false"):
        validate(cfg)
    cfg.rollout.colocate = False
    validate(cfg)
    cfg.algo.old_logprob_source = "rollout"
    with pytest.raises(ConfigError, match=r"pi_old must be the actor's recompute"):
        validate(cfg)


def test_the_correction_follows_the_schedule_unless_set():
    cfg = Config()
    assert cfg.algo.rollout_correction == "auto" and cfg.rollout_correction() == "none"
    cfg.rollout.async_steps, cfg.rollout.colocate = 1, False
    assert cfg.rollout_correction() == "token_tis"
    cfg.algo.rollout_correction = "seq_mis"
    assert cfg.rollout_correction() == "seq_mis"


# --- the loop end to end (embedded engine) ----------------------------------------------------------------

def test_an_async_run_trains_one_version_behind_with_the_correction(base_dir, tmp_path, python_env):
    r = run_train(train_cmd(base_dir, tmp_path, "async", "train.steps=3", "checkpoint.save_every=0", *ASYNC),
                  python_env)
    assert "off-policy pipelining, rollout.async_steps=1" in r.stderr and "rollout correction token_tis" in r.stderr
    assert "embedded, in its own process (1 thread, pid" in r.stderr  # the engine beside the actor, not a thread
    tb = read_scalars(tmp_path / "tb" / "async")
    assert tb["rollout/staleness_mean"] == {1: 0.0, 2: 1.0, 3: 1.0}
    assert tb["rollout/staleness_max"] == {1: 0.0, 2: 1.0, 3: 1.0}
    assert tb["rollout/dropped_stale_groups"] == {1: 0.0, 2: 0.0, 3: 0.0}
    assert abs(tb["rollout_corr/weight_mean"][1] - 1.0) < 1e-6  # batch 1 is on-policy
    assert tb["rollout_corr/kl_k3"][3] > 0  # later batches come from older weights
    for tag in ("timing/overlap_s", "timing/actor_idle_s", "timing/engine_idle_s"):
        assert set(tb[tag]) == {1, 2, 3}


def test_a_synchronous_run_on_its_own_devices_has_no_staleness_and_no_correction(base_dir, tmp_path, python_env):
    """rollout.colocate=false without pipelining: the engine keeps its own cores (its own process, as its own
    GPUs would be) and takes each step's weights, so every batch is on-policy."""
    r = run_train(train_cmd(base_dir, tmp_path, "sync", "train.steps=2", "checkpoint.save_every=0",
                            "rollout.colocate=false"), python_env)
    assert "rollout schedule: synchronous" in r.stderr and "rollout correction none" in r.stderr
    assert "attention torch SDPA (model.local_attention=sdpa)" in r.stderr  # the start-up summary's layout line
    assert "embedded, in its own process (1 thread, pid" in r.stderr and "the actor keeps 1)" in r.stderr
    assert "the engine is on its own devices (rollout.colocate=false)" in r.stderr
    tb = read_scalars(tmp_path / "tb" / "sync")
    assert not [t for t in tb if t.startswith(("rollout/staleness", "rollout_corr/", "timing/overlap"))]
    # the engine sampled step 2 from the weights after step 1: its logprobs are the actor's pi_old
    assert max(tb["rollout/train_rollout_logprob_absdiff"].values()) < 1e-4


@pytest.mark.slow
def test_a_killed_async_run_resumes_exactly(base_dir, tmp_path, python_env):
    """SIGKILL after the step-2 checkpoint (which holds batches 3 .. 2+k, made from the weights after steps
    up to 1), then resume=auto: steps 3 .. 3+k write what the uninterrupted run wrote, the last of them on a
    batch the resumed engine generated from the checkpoint's weights. k = 2: the checkpoint holds a batch and
    one more (k = 1's single batch is its first part)."""
    k = 2
    last = 3 + k
    # dynamic sampling off: every step trains (on the session's seconds-old base a step may keep no group, skip its
    # update and write no actor/* monitor: CI saw step 5 missing from both runs)
    steps = [f"train.steps={last}", "checkpoint.save_every=1", "eval.every_steps=0", "rollout.colocate=false",
             f"rollout.async_steps={k}", "algo.dynamic_sampling=false"]
    run_train(train_cmd(base_dir, tmp_path, "straight", *steps), python_env)
    marker = tmp_path / "ckpt" / "killed" / "step_00000002" / "COMPLETE"
    kill_job_at(train_cmd(base_dir, tmp_path, "killed", *steps), python_env, marker)
    assert marker.exists(), "the run never reached its step-2 checkpoint"
    saved = json.loads((marker.parent / "trainer_state.json").read_text())["trainer"]["pending"]
    assert [saved["step"], *(b["step"] for b in saved["more"])] == list(range(3, 3 + k))
    run_train(train_cmd(base_dir, tmp_path, "killed", *steps, "checkpoint.resume=auto"), python_env)
    a, b = read_scalars(tmp_path / "tb" / "straight"), read_scalars(tmp_path / "tb" / "killed")
    for tag in [*TAGS, "rollout/staleness_mean", "rollout_corr/weight_mean", "rollout_corr/kl_k3"]:
        if tag.startswith(("timing/", "perf/", "val/")):
            continue
        assert set(a[tag]) == set(b[tag]) == set(range(1, last + 1)), (tag, sorted(a[tag]), sorted(b[tag]))
        for step in range(3, last + 1):
            assert a[tag][step] == b[tag][step], (tag, step, a[tag][step], b[tag][step])


def test_bench_async_reports_the_ratio_beside_the_overlap_limit():
    """tools/bench_async.py's arithmetic: generation 3 s + training 1 s a step cannot overlap below 3/4."""
    import runpy

    compare = runpy.run_path(str(REPO / "tools" / "bench_async.py"))["compare"]

    sync = {"timing/rollout_s": [3.0, 3.0], "timing/reward_s": [0.5, 0.5], "timing/step_s": [4.0, 4.0],
            "perf/tokens_per_s": [10.0, 10.0]}
    pipe = {"timing/step_s": [3.2, 3.4], "timing/actor_idle_s": [2.0, 2.2], "timing/engine_idle_s": [0.1, 0.1],
            "timing/overlap_s": [1.0, 1.0], "perf/tokens_per_s": [12.0, 12.0]}
    row = compare("tiny", "embedded", 1, sync, pipe)
    assert row["limit"] == 0.75 and abs(row["ratio"] - 3.3 / 4.0) < 1e-12 and row["async_steps"] == 1
    assert (row["sync_generate_s"], row["sync_train_s"], row["async_actor_idle_s"]) == (3.0, 1.0, 2.1)


@pytest.mark.parametrize("name", ["tiny", "steps", "smollm2"])
def test_bench_async_runs_valid_configs_on_each_base(name):
    """Each base's config with the bench's overrides passes validation, synchronous and pipelined."""
    import runpy

    from megatron_dapo.config import load_config

    tool = runpy.run_path(str(REPO / "tools" / "bench_async.py"))
    _, config, sized = tool["BASES"][name]
    for async_steps, mode in ((0, "batch"), (1, "batch"), (1, "stream")):
        cfg = load_config(str(REPO / config), [*tool["COMMON"], *sized, f"rollout.async_steps={async_steps}",
                                               f"rollout.async_mode={mode}", "rollout.streaming=true"])
        validate(cfg)
        assert not cfg.rollout.colocate and cfg.rollout.async_steps == async_steps


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
