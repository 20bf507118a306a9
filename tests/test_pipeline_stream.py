"""Fully async pipelining (`rollout.async_mode=stream`): new weights interrupt the batch in production. The
group stream aborts its in-flight groups at the next arrival, the engine takes the weights, the groups
continue from where they stopped, and each token records the version that made it. Checked against plain
transformers: each token's rollout logprob is that of the policy its recorded version names. Then the
pipeline's hand-over of the newest weights, the config checks, and end-to-end runs on the embedded engine
(and a real SGLang server, sglang tier)."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import pytest
import torch
from support import run_train, train_cmd

from megatron_dapo.config import Config, ConfigError, validate
from megatron_dapo.metrics import read_scalars
from megatron_dapo.rollout import EmbeddedEngine, SamplingParams
from megatron_dapo.rollout.base import GroupRequest
from megatron_dapo.rollout.embedded.process_engine import ProcessEngine
from megatron_dapo.schedule.pipeline import RolloutPipeline, WeightSnapshot
from megatron_dapo.collect.result import StepRollout, StreamRollout
from megatron_dapo.collect.streaming import StreamPlan, stream_groups
from megatron_dapo.collect.versions import stamp
from megatron_dapo.tiny import tiny_model
from megatron_dapo.types import Prompt, Sample

SMALL: dict[str, Any] = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22], [30], [40, 41, 42, 43]]
STOPS = tuple(range(3, 128, 11))

pytestmark = pytest.mark.usefixtures("one_thread")


class Live:
    """LiveWeights for the test: after `after` groups have arrived, the weights of `model` are published."""

    def __init__(self, engine, model, after: int) -> None:
        self.engine, self.model, self.after, self.version, self.arrived = engine, model, after, 0, 0

    def fresher(self) -> bool:
        return self.version == 0 and self.arrived >= self.after

    def refresh(self) -> None:
        self.engine.update_weights(list(self.model.state_dict().items()))
        self.version = 1

    def waiting(self, stream):
        return contextlib.nullcontext()

    def interruption(self):
        return None  # nobody else aborts the stream: it aborts itself at the next arrival


def run_stream(engine, live, keep: int = len(PROMPTS)) -> StreamRollout:
    def request(g: int):
        return Prompt(str(g), (), "1"), GroupRequest(key=g, prompt_ids=PROMPTS[g], n=3, sampling=SamplingParams(
            max_new_tokens=24, stop_token_ids=STOPS, seed=100 + 1000 * g))

    def score(group) -> None:
        live.arrived += 1
        for s in group.samples:
            s.reward, s.acc = 1.0, True

    plan = StreamPlan(target_groups=keep, first=len(PROMPTS), max_inflight=len(PROMPTS),
                      max_groups=len(PROMPTS), dynamic_sampling=False)
    return stream_groups(engine, request, score, plan, weights=live)


def teacher_forced(model, sample: Sample) -> torch.Tensor:
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logp = model(ids).logits[0].float().log_softmax(-1)
    n = len(sample.prompt_ids)
    return logp[n - 1:-1].gather(-1, ids[0, n:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def models():
    return tiny_model("qwen2", seed=0, **SMALL), tiny_model("qwen2", seed=1, **SMALL)


@pytest.mark.parametrize("kind", ["in_process", "process"])
def test_new_weights_interrupt_the_batch_and_each_token_records_its_policy(models, kind, tmp_path):
    """After the first group arrives the weights change: the five groups in flight are aborted with their
    samples so far, resumed on the new weights, and every token's rollout logprob is the one the policy of its
    recorded version gives it (plain transformers, 1e-4); some samples span both versions."""
    old, new = models
    old.save_pretrained(tmp_path)
    engine = EmbeddedEngine(tmp_path) if kind == "in_process" else ProcessEngine(tmp_path, threads=1)
    try:
        out = run_stream(engine, Live(engine, new, after=1))
    finally:
        engine.shutdown()
    assert out.stream.weight_updates == 1 and out.stream.interrupted_groups == len(PROMPTS) - 1
    assert out.cost()["rollout/weight_updates"] == 1.0 and out.cost()["rollout/interrupted_groups"] == 5.0
    samples = [s for g in out.generated for s in g.samples]
    assert out.stream.generated_tokens == sum(s.response_len for s in samples)
    spanning = check_versions(samples, models)
    assert spanning > 0, [s.versions for s in samples]


def check_versions(samples: list[Sample], models) -> int:
    """Each token's rollout logprob is its version's policy's; the samples that span two versions."""
    spanning = 0
    for s in samples:
        starts = [a for a, _ in s.versions] + [s.response_len]
        assert starts[0] == 0 and starts == sorted(starts) and [v for _, v in s.versions] == sorted({v for _, v in s.versions})
        spanning += len(s.versions) == 2
        for (a, v), b in zip(s.versions, starts[1:]):
            got = torch.tensor(s.rollout_logprobs[a:b])
            torch.testing.assert_close(got, teacher_forced(models[v], s)[a:b], atol=1e-4, rtol=0)
    return spanning


@pytest.fixture(scope="module")
def slower():
    """Models whose 400-token groups take ~0.7 s to decode here."""
    size: dict[str, Any] = {**SMALL, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4}
    return tiny_model("qwen2", seed=0, **size), tiny_model("qwen2", seed=1, **size)


def interrupted_mid_batch(engine, newer: list, return_routes: bool = False) -> tuple[StreamRollout, int]:
    """Six groups of 400 tokens each streamed on `engine` (shut down after) while the actor publishes step 1's
    weights `newer` a few decode steps in: the rollout and the pipeline's version after it."""
    pipe = RolloutPipeline(threads=1, depth=1, stream=True)
    pipe.apply_weights = lambda snap: engine.update_weights(snap.tensors)
    box: dict[str, Any] = {}

    def request(g: int):
        return Prompt(str(g), (), "1"), GroupRequest(key=g, prompt_ids=PROMPTS[g], n=2, sampling=SamplingParams(
            max_new_tokens=400, ignore_eos=True, seed=100 + 1000 * g, return_routes=return_routes))

    plan = StreamPlan(target_groups=6, first=6, max_inflight=6, max_groups=6, dynamic_sampling=False)
    producer = threading.Thread(target=lambda: box.update(out=stream_groups(engine, request, lambda g: None, plan,
                                                                            weights=pipe)))
    try:
        producer.start()
        deadline = time.monotonic() + 60
        while pipe._live is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.15)  # some decode steps, not all
        pipe.publish(1, WeightSnapshot(1, newer))
        producer.join(120)
    finally:
        engine.shutdown()
        pipe.close()
    return box["out"], pipe.version


@pytest.mark.parametrize("kind", ["in_process", "process"])
def test_published_weights_stop_the_engine_at_its_next_decode_step(slower, kind, tmp_path):
    """The producer waits in `next()` for six groups of 400 tokens each (all decoded in lockstep, so none
    arrives before the others); the actor publishes step 1's weights: the pipeline aborts the stream there
    and then, the engine takes the weights, every group resumes on them, and every sample spans both
    versions, each token's logprob its recorded version's policy's."""
    old, new = slower
    old.save_pretrained(tmp_path)
    engine = EmbeddedEngine(tmp_path) if kind == "in_process" else ProcessEngine(tmp_path, threads=1)
    out, version = interrupted_mid_batch(engine, list(new.state_dict().items()))
    assert out.stream.weight_updates == 1 and out.stream.interrupted_groups == 6 and version == 1
    assert check_versions([s for g in out.generated for s in g.samples], slower) == 12


def test_an_interrupted_groups_routes_are_each_versions(tmp_path):
    """r3 in stream mode: a MoE policy's groups are interrupted by newer weights and continue on them. Each sample's
    routes are those of the policy that read each position: the old one up to the position before its first token
    of the new version, the new one from there (every clear choice, against each model's own routing)."""
    from support import forward_routes

    size: dict[str, Any] = {**SMALL, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2}
    old, new = tiny_model("qwen3_moe", seed=0, **size), tiny_model("qwen3_moe", seed=1, **size)
    old.save_pretrained(tmp_path)
    new.save_pretrained(tmp_path / "new")  # the checkpoint's names, as the actor exports them
    from safetensors.torch import load_file

    newer = list(load_file(str(tmp_path / "new" / "model.safetensors")).items())
    out, _ = interrupted_mid_batch(EmbeddedEngine(tmp_path), newer, return_routes=True)
    samples = [s for g in out.generated for s in g.samples]
    assert out.stream.interrupted_groups > 0
    spanning = 0
    for s in samples:
        ids = s.prompt_ids + s.response_ids
        assert s.routes is not None and s.routes.shape[0] == len(ids) - 1
        switch = len(s.prompt_ids) + (s.versions[1][0] if len(s.versions) == 2 else s.response_len) - 1
        spanning += len(s.versions) == 2
        for model, rows in ((old, slice(0, switch)), (new, slice(switch, len(ids) - 1))):
            ref, gap = forward_routes(model, ids)
            clear = gap[rows] > 1e-4
            same = (s.routes[rows].long().sort(-1).values == ref[rows].sort(-1).values).all(-1)
            assert bool(same[clear].all()), (s.versions, rows)
    assert spanning > 0


def test_the_same_weights_mid_batch_change_nothing(models, tmp_path):
    """Interrupting and resuming on unchanged weights gives the uninterrupted stream's samples exactly."""
    old, _ = models
    engine = EmbeddedEngine(tiny_model("qwen2", seed=0, **SMALL))
    try:
        plain = run_stream(engine, Live(engine, old, after=99))
        again = run_stream(engine, Live(engine, old, after=1))
    finally:
        engine.shutdown()
    assert plain.stream.weight_updates == 0 and again.stream.weight_updates == 1
    key = {g.prompt.uid: g for g in plain.generated}
    for g in again.generated:
        for a, b in zip(key[g.prompt.uid].samples, g.samples):
            assert a.response_ids == b.response_ids and a.finish_reason == b.finish_reason
            torch.testing.assert_close(torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs),
                                       atol=1e-5, rtol=0)


def test_tokens_made_before_an_update_and_then_aborted_count_as_wasted(models):
    """Two groups kept of six: the four aborted at the end lose what they made before and after the update,
    so every generated token is either trained or wasted."""
    _, new = models
    engine = EmbeddedEngine(tiny_model("qwen2", seed=0, **SMALL))
    try:
        out = run_stream(engine, Live(engine, new, after=1), keep=2)
    finally:
        engine.shutdown()
    kept = sum(s.response_len for g in out.groups for s in g.samples)
    assert out.stream.weight_updates == 1 and out.stream.aborted_groups == 4 and out.stream.wasted_tokens > 0
    assert out.stream.generated_tokens == kept + out.stream.wasted_tokens


def test_an_unfinished_sample_without_tokens_has_no_version_yet():
    """A group aborted before it started carries empty samples: no policy made them, so they are not stamped
    (else a resumed sample would look older than its tokens)."""
    empty = Sample(prompt_ids=[1], response_ids=[], rollout_logprobs=[], finish_reason="abort")
    stamp([empty], 3)
    assert empty.versions == []
    done = Sample(prompt_ids=[1], response_ids=[5, 6], rollout_logprobs=[-1.0, -1.0], finish_reason="stop")
    stamp([done], 4, (empty,))
    assert done.versions == [(0, 4)]


def test_the_pipeline_hands_the_newest_weights_over_mid_batch():
    """async_mode=stream with k=1: the snapshot of step 1, published while batch 2 is in production, is
    fresher than the engine's weights and taken by `refresh`; batch 3 starts on the newest (step 2's), not
    only on those it is due (step 1's). Without stream mode nothing is fresher mid-batch."""
    taken = []
    pipe = RolloutPipeline(threads=1, depth=1, stream=True)
    pipe.apply_weights = lambda snap: taken.append(snap.version)
    pipe.produce = lambda step: StepRollout([], None)
    pipe.publish(1, WeightSnapshot(1))
    assert pipe.fresher()
    pipe.refresh()
    assert taken == [1] and pipe.version == 1 and not pipe.fresher()
    pipe.publish(2, WeightSnapshot(2))
    pipe.take(3)
    assert taken == [1, 2] and pipe.version == 2
    pipe.publish(3, None)  # step 3 made no update: nothing to interrupt a batch for
    assert not pipe.fresher()
    batch = RolloutPipeline(threads=1, depth=2)
    batch.publish(1, WeightSnapshot(1))
    assert not batch.fresher()
    pipe.close()
    batch.close()


def test_stream_mode_needs_pipelining_and_the_group_stream():
    cfg = Config()
    cfg.rollout.async_mode, cfg.rollout.colocate = "stream", False
    with pytest.raises(ConfigError, match=r"async_mode=stream needs off-policy pipelining"):
        validate(cfg)
    cfg.rollout.async_steps, cfg.rollout.streaming = 1, False
    with pytest.raises(ConfigError, match=r"set rollout.streaming=true"):
        validate(cfg)
    cfg.rollout.streaming, cfg.rollout.engine = True, "sglang"
    validate(cfg, world_size=1)
    with pytest.raises(ConfigError, match=r"async_mode=stream with SGLang needs a one-rank job"):
        validate(cfg, world_size=2)


STREAM = ["train.steps=4", "checkpoint.save_every=0", "rollout.colocate=false", "rollout.async_steps=1",
          "rollout.async_mode=stream", "rollout.streaming=true", "rollout.weight_sync_probe=true"]


def check_stream_run(tb: dict) -> None:
    assert set(tb["rollout/staleness_max"]) == {1, 2, 3, 4} and max(tb["rollout/staleness_max"].values()) <= 1
    assert tb["rollout/dropped_stale_groups"] == {1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0}
    assert set(tb["rollout/weight_updates"]) == {1, 2, 3, 4}
    assert max(tb["rollout/weight_sync_probe_absdiff"].values()) < 1e-4


def test_a_fully_async_run_trains_at_most_k_versions_behind(base_dir, tmp_path, python_env):
    """async_mode=stream, k=1, on the embedded engine's process: each step's snapshot reaches the engine (the
    probe checks it there), no trained token is more than one update older than the actor, an evaluation
    runs on the newest weights."""
    r = run_train(train_cmd(base_dir, tmp_path, "stream", *STREAM, "eval.every_steps=2"), python_env)
    assert "fully async, rollout.async_steps=1 async_mode=stream" in r.stderr
    tb = read_scalars(tmp_path / "tb" / "stream")
    check_stream_run(tb)
    assert tb["val/policy_version"] == {0: 0.0, 2: 2.0, 4: 4.0}


@pytest.mark.sglang
@pytest.mark.timeout(1500)
def test_sglang_fully_async(sglang_python, base_dir, tmp_path, python_env):
    """The same on a real SGLang server with its own cores: the producer aborts, updates and resumes it."""
    from sglang_support import server_ports

    cmd = train_cmd(base_dir, tmp_path, "sgs", *STREAM, "rollout.engine=sglang",
                    f"rollout.sglang.base_port={server_ports()}")
    run_train(cmd, {**python_env, "MEGATRON_DAPO_SGLANG_PYTHON": sglang_python, "OMP_NUM_THREADS": "2"},
              timeout=1400)
    check_stream_run(read_scalars(tmp_path / "tb" / "sgs"))
