"""Partial rollout. On the embedded engine an aborted stream reports each cancelled group's samples so far,
and resubmitting them (`GroupRequest.resume`) continues every response exactly where it stopped: the
finished responses are those of a stream that was never aborted (tokens identical, logprobs to 1e-5).
Then the loop (collect/streaming.py): a step hands its aborted groups to the next, token accounting, the
checkpointed carry, config checks. Then SGLang's stream against a scripted server: aborted responses come
back with their logprobs and continue from where they stopped (tests/test_rollout_sglang_streaming.py
runs it on the real server)."""

import dataclasses
import json
import time
from typing import Any

import pytest
import torch

from megatron_dapo.config import ConfigError, load_config, validate
from megatron_dapo.collect.carry import PartialCarry
from megatron_dapo.collect.seeds import seed_of
from megatron_dapo.collect.streaming import StreamPlan, stream_groups
from megatron_dapo.rollout import EmbeddedEngine, SamplingParams
from megatron_dapo.rollout.base import GroupRequest, RolloutStream
from megatron_dapo.tiny import tiny_model
from megatron_dapo.types import Prompt, Sample

VOCAB = 128
SMALL: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22], [30], [40, 41, 42, 43]]
STOPS = tuple(range(3, VOCAB, 11))

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine():
    return EmbeddedEngine(tiny_model("qwen2", seed=0, **SMALL))


def requests(max_new: int = 24) -> list[GroupRequest]:
    return [GroupRequest(key=g, prompt_ids=p, n=3, sampling=SamplingParams(
        max_new_tokens=max_new, stop_token_ids=STOPS, seed=100 + 1000 * g)) for g, p in enumerate(PROMPTS)]


def resumed_requests(report) -> list[GroupRequest]:
    return [dataclasses.replace(r, resume=tuple(report.partial[r.key]))
            for r in requests() if r.key in report.partial]


def drain(stream: RolloutStream) -> dict[int, list[Sample]]:
    out = {}
    while stream.pending:
        result = stream.next()
        out[result.key] = result.samples
    return out


def same(a: Sample, b: Sample) -> None:
    assert a.response_ids == b.response_ids and a.finish_reason == b.finish_reason
    torch.testing.assert_close(torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs),
                               atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def reference(engine) -> dict[int, list[Sample]]:
    with engine.stream() as stream:
        stream.submit(requests())
        return drain(stream)


@pytest.fixture(scope="module")
def interrupted(engine):
    """Two groups collected, the rest aborted mid-generation."""
    with engine.stream() as stream:
        stream.submit(requests())
        done = {r.key: r.samples for r in (stream.next(), stream.next())}
        return done, stream.abort()


def test_abort_reports_every_cancelled_group_so_far(reference, interrupted):
    done, report = interrupted
    assert sorted(report.partial) == report.keys == sorted(set(reference) - set(done))
    cut = 0
    for key, samples in report.partial.items():
        assert len(samples) == 3
        for s, ref in zip(samples, reference[key]):
            assert s.prompt_ids == PROMPTS[key]
            if s.finish_reason == "abort":
                assert s.response_ids == ref.response_ids[: s.response_len]
                assert len(s.rollout_logprobs) == s.response_len
                cut += 0 < s.response_len < ref.response_len
            else:
                same(s, ref)
    assert cut > 0, "no response was cut mid-way: the test does not exercise continuation"
    assert report.tokens == sum(s.response_len for v in report.partial.values() for s in v)


def test_resumed_groups_finish_as_if_never_aborted(engine, reference, interrupted):
    _, report = interrupted
    with engine.stream() as stream:
        stream.submit(resumed_requests(report))
        resumed = drain(stream)
    assert sorted(resumed) == report.keys
    for key, samples in resumed.items():
        for s, ref in zip(samples, reference[key]):
            same(s, ref)


def test_an_abort_right_after_resuming_hands_the_carried_samples_back(engine, interrupted):
    _, report = interrupted
    with engine.stream() as stream:
        stream.submit(resumed_requests(report))
        again = stream.abort()
    assert again.tokens == 0  # carried-in tokens are not generated twice
    for key, samples in again.partial.items():
        assert [s.response_ids for s in samples] == [s.response_ids for s in report.partial[key]]


def test_a_group_resumed_with_every_sample_finished_comes_back_at_once(engine, reference):
    req = dataclasses.replace(requests()[0], resume=tuple(reference[0]))
    with engine.stream() as stream:
        stream.submit([req])
        result = stream.next()
        assert result.key == 0 and result.samples == reference[0] and not stream.pending


def test_an_engine_group_hands_back_every_engines_partial_groups(reference):
    from megatron_dapo.rollout.engine_group import EngineGroup

    engines = [EmbeddedEngine(tiny_model("qwen2", seed=0, **SMALL)) for _ in range(2)]
    with EngineGroup(engines, names=["a", "b"]) as group, group.stream() as stream:
        stream.submit(requests())
        first = stream.next().key
        report = stream.abort()
    assert sorted(report.partial) == report.keys == sorted(set(reference) - {first})
    for key, samples in report.partial.items():
        for s, ref in zip(samples, reference[key]):
            assert s.response_ids == ref.response_ids[: s.response_len]


@pytest.mark.parametrize("bad, match", [
    (lambda s: [s[0]], "resume has 1 samples, n=3"),
    (lambda s: [dataclasses.replace(s[0], prompt_ids=[99])] + s[1:], "belongs to another prompt"),
    (lambda s: [dataclasses.replace(s[0], rollout_logprobs=[])] + s[1:], "logprobs"),
    (lambda s: [dataclasses.replace(s[0], response_ids=[5] * 24, rollout_logprobs=[0.0] * 24,
                                    finish_reason="abort")] + s[1:], "already has 24 tokens"),
])
def test_malformed_resume_is_refused(reference, bad, match):
    samples = [dataclasses.replace(s) for s in reference[0]]
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(requests()[0], resume=tuple(bad(samples)))


# ------------------------------------------------------------------ the loop: carry from step to step

def source(offset: int):
    """Group g: prompt uid p/<offset + g>, every other group informative, lengths varied."""
    def request(g: int):
        i = offset + g
        prompt = Prompt(uid=f"p/{i}", messages=(), ground_truth=str(i % 2))
        return prompt, GroupRequest(key=g, prompt_ids=[1 + i % 50, 2, 3], n=2, sampling=SamplingParams(
            max_new_tokens=6 + (i % 4) * 12, ignore_eos=True, seed=seed_of(1, "train", 0, "group", i)))
    return request


def score(group) -> None:
    for k, s in enumerate(group.samples):
        s.acc = group.prompt.ground_truth == "1" and k == 0
        s.reward = 1.0 if s.acc else -1.0


def test_the_next_step_continues_the_aborted_groups(engine):
    plan = StreamPlan(target_groups=3, first=6, max_inflight=8, max_groups=40, partial=True)
    one = stream_groups(engine, source(0), score, plan)
    assert one.carry and one.stream.carried_groups == len(one.carry) == one.stream.aborted_groups
    assert one.stream.wasted_tokens == 0
    assert one.stream.carried_tokens == sum(s.response_len for _, r in one.carry for s in r.resume) > 0
    two = stream_groups(engine, source(100), score, plan, one.carry)
    assert two.stream.resumed_groups == len(one.carry)
    carried = {p.uid: r for p, r in one.carry}
    resumed = [g for g in two.generated if g.prompt.uid in carried]
    assert resumed, "no carried group finished in the next step"
    for g in resumed:  # as if never aborted: the same request run to the end in one stream
        with engine.stream() as stream:
            stream.submit([dataclasses.replace(carried[g.prompt.uid], resume=())])
            for s, ref in zip(g.samples, stream.next().samples):
                same(s, ref)
    finished = sum(s.response_len for g in two.generated for s in g.samples)
    assert two.stream.generated_tokens == finished + two.stream.carried_tokens - one.stream.carried_tokens
    costs = two.cost()
    assert costs["rollout/resumed_groups"] == len(one.carry) and costs["rollout/wasted_tokens"] == 0.0


def test_without_partial_rollout_nothing_is_carried(engine):
    plan = StreamPlan(target_groups=3, first=6, max_inflight=8, max_groups=40)
    out = stream_groups(engine, source(0), score, plan)
    assert not out.carry and out.stream.aborted_groups > 0 and out.stream.wasted_tokens > 0
    assert "rollout/carried_groups" not in out.cost()


def test_the_carry_survives_a_checkpoint(engine):
    plan = StreamPlan(target_groups=3, first=6, max_inflight=8, max_groups=40, partial=True)
    carry = stream_groups(engine, source(0), score, plan).carry
    back = PartialCarry.from_state(json.loads(json.dumps(carry.state_dict())))
    assert back == carry


def long_then_short(offset: int):
    """Group 0: 40 tokens, never informative; every later group: 2 tokens, informative."""
    def request(g: int):
        long = g == 0
        prompt = Prompt(uid=f"s/{offset + g}", messages=(), ground_truth="0" if long else "1")
        return prompt, GroupRequest(key=g, prompt_ids=[5, 6, 7], n=2, sampling=SamplingParams(
            max_new_tokens=40 if long else 2, ignore_eos=True, seed=offset + g))
    return request


@pytest.mark.parametrize("max_carry_steps, dropped", [(1, True), (2, False), (0, False)])
def test_a_group_is_carried_at_most_max_carry_steps(engine, max_carry_steps, dropped):
    """Step one keeps the short group and carries the long one (carried once); step two keeps its fresh short
    group and aborts the long one again: a second carry exceeds max_carry_steps=1, so it is dropped and all
    its tokens (both steps') are wasted; with 2, or 0 (no bound), it is carried on."""
    plan = StreamPlan(target_groups=1, first=2, max_inflight=2, max_groups=10, partial=True,
                      max_carry_steps=max_carry_steps)
    one = stream_groups(engine, long_then_short(0), score, plan)
    assert [p.uid for p, _ in one.carry] == ["s/0"] and one.carry.groups[0][1].carried_steps == 1
    two = stream_groups(engine, long_then_short(100), score, plan, one.carry)
    assert [g.prompt.uid for g in two.groups] == ["s/101"] and two.stream.aborted_groups == 1
    long_total = one.stream.carried_tokens + two.stream.generated_tokens - 2 * 2  # less the fresh group's
    assert 0 < one.stream.carried_tokens < long_total < 2 * 40
    costs = two.cost()
    if dropped:
        assert not two.carry and two.stream.dropped_stale_groups == 1
        assert two.stream.wasted_tokens == long_total
        assert costs["rollout/dropped_stale_groups"] == 1.0
    else:
        assert [(p.uid, r.carried_steps) for p, r in two.carry] == [("s/0", 2)]
        assert two.stream.wasted_tokens == 0 and two.stream.dropped_stale_groups == 0
        assert two.stream.carried_tokens == long_total
        assert costs["rollout/dropped_stale_groups"] == 0.0


def test_a_checkpoint_from_before_carried_steps_loads_as_never_carried(engine):
    plan = StreamPlan(target_groups=3, first=6, max_inflight=8, max_groups=40, partial=True)
    state = stream_groups(engine, source(0), score, plan).carry.state_dict()
    for item in state:
        del item["request"]["carried_steps"]
    assert {r.carried_steps for _, r in PartialCarry.from_state(state)} == {0}


def test_partial_rollout_needs_streaming():
    with pytest.raises(ConfigError, match="rollout.partial_rollout needs rollout.streaming=true"):
        validate(load_config(None, ["rollout.partial_rollout=true", "rollout.streaming=false"]))
    for engine in ("embedded", "sglang"):
        # rollout.streaming is true by default
        validate(load_config(None, ["rollout.partial_rollout=true", f"rollout.engine={engine}"]))


# ------------------------------------------------------------------ SGLang's side, on a scripted server

class ScriptedServer:
    """Answers /generate like SGLang: every request aborted after `cut` tokens, or run to its
    max_new_tokens; token i of a response is 100 + (its input length + i), logprob -(token / 1000)."""

    url = "http://scripted:1"
    vocab_size = 1000  # every scripted token id lies below it

    def __init__(self, cut: int | None):
        self.cut = cut
        self.bodies: list[dict] = []

    def dead_reason(self):
        return None

    def routes_of(self, sampling):  # SGLangEngine's: a dense model has none
        return None

    def _http(self, *a, **k):
        return {}

    def post(self, path: str, body: dict):
        assert path == "/generate"
        self.bodies.append(body)
        items = []
        for ids, params in zip(body["input_ids"], body["sampling_params"]):
            count = params["max_new_tokens"] if self.cut is None else min(self.cut, params["max_new_tokens"])
            out = [100 + len(ids) + i for i in range(count)]
            reason = {"type": "length"} if self.cut is None else {"type": "abort", "message": "aborted"}
            items.append({"output_ids": out, "meta_info": {"finish_reason": reason,
                          "output_token_logprobs": [[-t / 1000, t, None] for t in out]}})
        return items


def test_sglang_stream_hands_back_aborted_responses_and_continues_them():
    from megatron_dapo.rollout.sglang.stream import SGLangStream

    req = GroupRequest(key=0, prompt_ids=[5, 6, 7], n=2, sampling=SamplingParams(max_new_tokens=10, seed=40))
    first = SGLangStream(ScriptedServer(cut=4))  # type: ignore[arg-type]  # a scripted stand-in
    first.submit([req])
    deadline = time.monotonic() + 60
    while not first._ready and time.monotonic() < deadline:  # the scripted call has come back aborted
        time.sleep(0.01)
    report = first.abort()
    first.close()
    assert report.keys == [0] and report.tokens == 8
    assert [s.response_ids for s in report.partial[0]] == [[103, 104, 105, 106]] * 2
    assert all(s.finish_reason == "abort" for s in report.partial[0])
    server = ScriptedServer(cut=None)
    with SGLangStream(server) as stream:  # type: ignore[arg-type]  # a scripted stand-in
        stream.submit([dataclasses.replace(req, resume=tuple(report.partial[0]))])
        result = stream.next()
    body = server.bodies[0]
    assert body["input_ids"] == [[5, 6, 7, 103, 104, 105, 106]] * 2
    assert [p["max_new_tokens"] for p in body["sampling_params"]] == [6, 6]
    assert [p["sampling_seed"] for p in body["sampling_params"]] == [40, 41]
    for s in result.samples:
        assert s.prompt_ids == [5, 6, 7] and s.finish_reason == "length"
        assert s.response_ids == [103, 104, 105, 106] + list(range(107, 113))
        assert s.rollout_logprobs == pytest.approx([-t / 1000 for t in s.response_ids])


@pytest.mark.parametrize("sampling, reason", [
    (SamplingParams(max_new_tokens=4, seed=1), "length"),  # every token it may have
    (SamplingParams(max_new_tokens=10, stop_token_ids=(106,), seed=1), "stop"),  # its last token stops it
])
def test_an_abort_that_meets_a_finished_request_reports_it_finished(sampling, reason):
    """The real server answered an aborted call with finish_reason "abort" and all 256 of 256 tokens; resuming
    such a sample was refused (check_resume). It is finished: it goes back as it is and nothing is sent."""
    from megatron_dapo.rollout.sglang.stream import SGLangStream

    req = GroupRequest(key=0, prompt_ids=[5, 6, 7], n=2, sampling=sampling)
    first = SGLangStream(ScriptedServer(cut=4))  # type: ignore[arg-type]  # a scripted stand-in
    first.submit([req])
    deadline = time.monotonic() + 60
    while not first._ready and time.monotonic() < deadline:
        time.sleep(0.01)
    report = first.abort()
    first.close()
    assert [s.finish_reason for s in report.partial[0]] == [reason] * 2
    assert [s.response_ids for s in report.partial[0]] == [[103, 104, 105, 106]] * 2
    server = ScriptedServer(cut=None)
    with SGLangStream(server) as stream:  # type: ignore[arg-type]  # a scripted stand-in
        stream.submit([dataclasses.replace(req, resume=tuple(report.partial[0]))])
        assert stream.next().samples == report.partial[0] and server.bodies == []


def test_sglang_resumes_only_the_unfinished_samples():
    from megatron_dapo.rollout.sglang.stream import SGLangStream

    done = Sample(prompt_ids=[5], response_ids=[9, 9], rollout_logprobs=[-1.0, -1.0], finish_reason="stop")
    cut = Sample(prompt_ids=[5], response_ids=[7], rollout_logprobs=[-0.5], finish_reason="abort")
    req = GroupRequest(key=3, prompt_ids=[5], n=2, sampling=SamplingParams(max_new_tokens=4),
                       resume=(done, cut))
    server = ScriptedServer(cut=None)
    with SGLangStream(server) as stream:  # type: ignore[arg-type]  # a scripted stand-in
        stream.submit([req])
        result = stream.next()
    assert server.bodies[0]["input_ids"] == [[5, 7]] and len(server.bodies) == 1
    assert result.samples[0] == done and result.samples[1].response_ids == [7, 102, 103, 104]


def test_no_request_id_of_a_stream_starts_another():
    """SGLang's /abort_request aborts every request whose id starts with the one named: aborting sample 1 of a
    group must not reach its samples 10 to 15, nor group 1 reach group 10's."""
    from megatron_dapo.rollout.sglang.stream import SGLangStream

    server = ScriptedServer(cut=None)
    with SGLangStream(server) as stream:  # type: ignore[arg-type]  # a scripted stand-in
        stream.submit([GroupRequest(key=g, prompt_ids=[5], n=16, sampling=SamplingParams(max_new_tokens=1, seed=g))
                       for g in (1, 10)])
        stream.next(), stream.next()
    rids = [rid for body in server.bodies for rid in body["rid"]]
    assert len(rids) == 32 and not [(a, b) for a in rids for b in rids if a != b and b.startswith(a)]
