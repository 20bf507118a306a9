"""Off-policy pipelining more than one batch ahead (`rollout.async_steps=k >= 2`, schedule/pipeline.py): the
fixed schedule (batch b from the weights after step b-1-k) whether the engine runs ahead or lags, the
snapshots the producer hands over, the batches a checkpoint holds, an evaluation on the newest weights, the
SGLang refusal; end to end on the embedded engine and on a real SGLang server. Resume: test_pipeline.py."""

from __future__ import annotations

import json
import threading

import pytest
import safetensors.torch
from support import TAGS, run_train, train_cmd

from megatron_dapo.algo.dynamic_sampling import DynamicSamplingStats
from megatron_dapo.config import Config, ConfigError, validate
from megatron_dapo.metrics import read_scalars
from megatron_dapo.schedule.pipeline import RolloutPipeline, WeightSnapshot
from megatron_dapo.collect.result import StepRollout
from megatron_dapo.types import Group, Prompt, Sample


def group(uid: str, version: int) -> Group:
    s = Sample(prompt_ids=[1, 2], response_ids=[3, 4], rollout_logprobs=[-0.5, -0.6], finish_reason="stop",
               response_text="Answer: 1", reward=1.0, acc=True, pred="1")
    s.versions = [(0, version)]
    return Group(Prompt(uid, ({"role": "user", "content": uid},), "1"), [s])


@pytest.mark.parametrize("lagging", [False, True])
def test_k2_schedule_each_batch_comes_from_the_weights_three_steps_back(lagging):
    """async_steps=2, the loop's order (take s, fill up to s+2, train s, publish a snapshot of step s): batch b
    is made from the snapshot of step b-3 (the start's weights before), whether the engine runs ahead (its
    batches made at once) or lags (each one made only after the actor has published a newer snapshot, so the
    engine must take the older one it is due, not the newest)."""
    engine = {"version": 0}
    made: dict[int, int] = {}
    taken: list[int] = []
    published = {s: threading.Event() for s in range(6)}
    pipe = RolloutPipeline(threads=1, depth=2)

    def produce(step: int) -> StepRollout:
        if lagging and step > 1:
            assert published[step - 1].wait(timeout=30)
        made[step] = engine["version"]
        return StepRollout([], None)

    def apply(snapshot: WeightSnapshot) -> None:
        taken.append(snapshot.version)
        engine["version"] = snapshot.version

    pipe.produce, pipe.apply_weights = produce, apply
    for step in range(1, 7):
        pipe.take(step)
        pipe.fill(step, last=6)
        pipe.publish(step, WeightSnapshot(step))  # the step's weights, for later
        published[min(step, 5)].set()
    pipe.close()
    assert made == {1: 0, 2: 0, 3: 0, 4: 1, 5: 2, 6: 3}
    assert taken == [1, 2, 3] and pipe.version == 3


def test_a_batch_due_weights_never_published_is_an_error():
    pipe = RolloutPipeline(threads=1, depth=2)
    pipe.produce, pipe.apply_weights = (lambda step: StepRollout([], None)), (lambda snapshot: None)
    pipe.publish(2, WeightSnapshot(2))
    pipe.start(5)  # due the weights after step 2, which need step 1's published first
    with pytest.raises(RuntimeError, match=r"due the weights after step 2, but those after step\(s\) \[1\]"):
        pipe.wait()
    pipe.close()


def test_a_step_without_an_update_hands_over_the_weights_before_it():
    """Step 2 made no update (no informative group): batch 5 is due the weights after step 2, which are
    step 1's snapshot; the engine takes that one."""
    taken: list[int] = []
    pipe = RolloutPipeline(threads=1, depth=2)
    pipe.produce, pipe.apply_weights = (lambda step: StepRollout([], None)), (lambda s: taken.append(s.version))
    pipe.publish(1, WeightSnapshot(1))
    pipe.publish(2, None)
    pipe.start(5)
    pipe.wait()
    assert taken == [1] and pipe.version == 2
    pipe.close()


def test_the_pipeline_runs_at_most_async_steps_batches_ahead():
    pipe = RolloutPipeline(threads=1, depth=2)
    pipe.produce = lambda step: StepRollout([], None)
    pipe.fill(1, last=9)
    assert [s for s, _ in pipe._pending] == [2, 3]
    with pytest.raises(RuntimeError, match="batch 4: the pipeline already holds 2 batch"):
        pipe.start(4)
    pipe.take(2)
    pipe.fill(2, last=3)  # the run ends at step 3: nothing more to start
    assert pipe.last_queued == 3
    pipe.close()


def test_a_deeper_pipeline_saves_every_batch_it_has_started():
    """async_steps=2 at the step-1 checkpoint: batches 2 and 3 (3 still in production) are waited for and
    saved; the resumed pipeline hands them over in order and knows its engine holds the step-1 weights."""
    release = threading.Event()

    def produce(step: int) -> StepRollout:
        if step == 3:
            assert release.wait(timeout=30)
        return StepRollout([group(f"b{step}", 0)], DynamicSamplingStats(1, 1, 1, 1.0, False), [group(f"b{step}", 0)])

    pipe = RolloutPipeline(threads=1, depth=2)
    pipe.produce = produce
    pipe.fill(1, last=9)
    threading.Timer(0.2, release.set).start()
    state = json.loads(json.dumps(pipe.state_dict()))
    assert state["step"] == 2 and [b["step"] for b in state["more"]] == [3]
    other = RolloutPipeline(threads=1, depth=2)
    other.load_state_dict(state, version=1)
    assert other.version == 1 and other.due_version(4) == 1
    assert [other.take(s).groups[0].prompt.uid for s in (2, 3)] == ["b2", "b3"]
    pipe.close()
    other.close()


def test_sglang_takes_lagged_weights_only_in_a_one_rank_job():
    """async_steps >= 2 hands the weights over from the driver's producer thread: SGLang servers that every
    rank updates cannot take them there; the embedded engine and a one-rank job can; 9 is out of range."""
    cfg = Config()
    cfg.rollout.async_steps, cfg.rollout.colocate, cfg.rollout.engine = 2, False, "sglang"
    validate(cfg, world_size=1)
    with pytest.raises(ConfigError, match=r"async_steps=2 async_mode=batch with SGLang needs a one-rank job .* rollout.async_steps=1"):
        validate(cfg, world_size=2)
    cfg.rollout.async_steps = 1
    validate(cfg, world_size=2)
    cfg.rollout.async_steps, cfg.rollout.engine = 2, "embedded"
    validate(cfg, world_size=2)
    cfg.rollout.async_steps = 9
    with pytest.raises(ConfigError, match=r"rollout.async_steps"):
        validate(cfg)


def test_a_two_ahead_run_trains_two_versions_behind_on_snapshots(base_dir, tmp_path, python_env):
    """async_steps=2: batches 1-3 come from the starting weights, batch 4 from step 1's snapshot, handed to the
    engine process and checked by the weight-sync probe there; staleness reaches 2 and no more. An evaluation
    after step 2 runs on the weights after step 2 (the batches in production finish, then the engine takes
    them) and leaves the training schedule as it was: every training monitor equals the run's without it."""
    two = ["train.steps=4", "checkpoint.save_every=0", "rollout.colocate=false", "rollout.async_steps=2",
           "rollout.weight_sync_probe=true"]
    r = run_train(train_cmd(base_dir, tmp_path, "async2", *two, "eval.every_steps=2"), python_env)
    assert "rollout.async_steps=2: the next step's batch generates while the actor trains, from weights 2 " in r.stderr
    run_train(train_cmd(base_dir, tmp_path, "no_eval", *two, "eval.every_steps=0"), python_env)
    tb, plain = read_scalars(tmp_path / "tb" / "async2"), read_scalars(tmp_path / "tb" / "no_eval")
    assert tb["rollout/staleness_max"] == {1: 0.0, 2: 1.0, 3: 2.0, 4: 2.0}
    assert tb["rollout/dropped_stale_groups"] == {1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0}
    assert max(tb["rollout/weight_sync_probe_absdiff"].values()) < 1e-4
    assert tb["rollout_corr/kl_k3"][4] > 0
    assert tb["val/policy_version"] == {0: 0.0, 2: 2.0, 4: 4.0}
    for tag in TAGS:
        if not tag.startswith(("timing/", "perf/", "val/", "memory/", "rollout/weight_sync_probe")):
            assert tb[tag] == plain[tag], tag
    # after step 1 its snapshot waits for batch 4; after the last step nothing is held (no batch is due)
    model = sum(t.numel() * t.element_size()
                for t in safetensors.torch.load_file(base_dir / "model.safetensors").values())
    assert plain["memory/weight_snapshot_bytes"][1] == model and plain["memory/weight_snapshot_bytes"][4] == 0


@pytest.mark.sglang
@pytest.mark.timeout(1500)
def test_sglang_two_ahead_takes_each_snapshot_between_batches(sglang_python, base_dir, tmp_path, python_env):
    """async_steps=2 on a real SGLang server with its own cores: the producer thread hands it each step's
    snapshot before the batch that is due it (the probe checks the server there), staleness reaches 2."""
    from sglang_support import server_ports

    cmd = train_cmd(base_dir, tmp_path, "sg2", "train.steps=4", "checkpoint.save_every=0", "rollout.engine=sglang",
                    f"rollout.sglang.base_port={server_ports()}", "rollout.colocate=false", "rollout.async_steps=2",
                    "rollout.weight_sync_probe=true")
    r = run_train(cmd, {**python_env, "MEGATRON_DAPO_SGLANG_PYTHON": sglang_python, "OMP_NUM_THREADS": "2"},
                  timeout=1400)
    assert "1 thread(s) each, the actor keeps 1: the engine is on its own devices" in r.stderr  # own cores
    tb = read_scalars(tmp_path / "tb" / "sg2")
    assert tb["rollout/staleness_max"] == {1: 0.0, 2: 1.0, 3: 2.0, 4: 2.0}
    assert max(tb["rollout/weight_sync_probe_absdiff"].values()) < 1e-4
