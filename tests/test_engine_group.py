"""EngineGroup: several rollout engines as one (the SGLang one-server-per-TP-group layout), checked with
real embedded engines against one engine, and with recording / failing engines for the contract."""

import threading
import time
from typing import Any

import pytest
import torch

from megatron_dapo.rollout import EmbeddedEngine, SamplingParams
from megatron_dapo.rollout.base import AbortReport, GenerationAborted, GroupRequest, GroupResult, RolloutEngine, RolloutStream
from megatron_dapo.rollout.engine_group import EngineGroup, EngineGroupError, split_evenly, split_weighted
from megatron_dapo.rollout.group_stream import GroupStream
from megatron_dapo.tiny import tiny_model
from megatron_dapo.types import Sample

SMALL: dict[str, Any] = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12], [13, 14, 15]]


def qwen2(seed: int):
    return tiny_model("qwen2", seed=seed, **SMALL)


@pytest.mark.parametrize("count, parts", [(6, 2), (7, 3), (2, 3), (0, 2), (5, 1)])
def test_split_evenly_covers_in_order(count, parts):
    bounds = split_evenly(count, parts)
    assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("count, weights, sizes", [
    (9, [1, 2], [3, 6]), (10, [1, 2], [3, 7]), (7, [2, 1, 1], [3, 2, 2]), (1, [1, 3], [0, 1]), (0, [1, 1], [0, 0]),
])
def test_split_weighted_is_proportional(count, weights, sizes):
    bounds = split_weighted(count, weights)
    assert [b - a for a, b in bounds] == sizes
    assert bounds[0][0] == 0 and bounds[-1][1] == count and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_nested_group_takes_its_share_and_keeps_seeds():
    solo, a, b = Recording(), Recording(), Recording()
    outer = EngineGroup([solo, EngineGroup([a, b])], weights=[1, 2])
    out = outer.generate(PROMPTS, 2, SamplingParams(seed=10, max_new_tokens=2))
    assert out == Recording().generate(PROMPTS, 2, SamplingParams(seed=10, max_new_tokens=2))
    assert [len(e.calls[0][0]) for e in (solo, a, b)] == [2, 2, 2]
    with pytest.raises(ValueError, match="one positive integer per engine"):
        EngineGroup([solo, a], weights=[1])


def test_group_of_embedded_engines_equals_one_engine():
    model = qwen2(0)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    one = EmbeddedEngine(model).generate(PROMPTS, 2, greedy)
    with EngineGroup([EmbeddedEngine(qwen2(0)), EmbeddedEngine(qwen2(0)), EmbeddedEngine(qwen2(0))]) as group:
        many = group.generate(PROMPTS, 2, greedy)
    assert [[s.response_ids for s in g] for g in many] == [[s.response_ids for s in g] for g in one]
    for g_many, g_one in zip(many, one):
        for a, b in zip(g_many, g_one):
            assert torch.allclose(torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs), atol=1e-5)


def test_update_weights_reaches_every_engine():
    target = qwen2(1)
    engines = [EmbeddedEngine(qwen2(0)), EmbeddedEngine(qwen2(0))]
    group = EngineGroup(engines)
    group.update_weights((name, p.detach().clone()) for name, p in target.named_parameters())
    greedy = SamplingParams(temperature=0.0, max_new_tokens=5)
    want = EmbeddedEngine(target).generate(PROMPTS[:2], 1, greedy)
    for engine in engines:
        got = engine.generate(PROMPTS[:2], 1, greedy)
        assert [g[0].response_ids for g in got] == [g[0].response_ids for g in want]
    group.shutdown()


class Recording(RolloutEngine):
    """Returns fake samples that carry the prompt and seed it saw; can fail on generate or update."""

    def __init__(self, fail_generate: bool = False, fail_after: int | None = None) -> None:
        self.calls: list[Any] = []
        self.received: list[str] = []
        self.events: list[str] = []
        self.fail_generate, self.fail_after = fail_generate, fail_after

    def generate(self, prompt_token_ids, n, sampling):
        self.calls.append((list(map(list, prompt_token_ids)), sampling.seed))
        if self.fail_generate:
            raise RuntimeError("boom")
        return [[(list(p), sampling.seed + i * n + k if sampling.seed is not None else None) for k in range(n)]
                for i, p in enumerate(prompt_token_ids)]

    def update_weights(self, named_tensors):
        for name, _ in named_tensors:
            if self.fail_after is not None and len(self.received) == self.fail_after:
                raise KeyError(f"unknown weight {name!r}")
            self.received.append(name)

    def sleep(self, tags=None):
        self.events.append("sleep")

    def wake(self, tags=None):
        self.events.append("wake")

    def abort(self):
        self.events.append("abort")

    def health(self):
        return True

    def shutdown(self):
        self.events.append("shutdown")


def test_seeds_and_order_are_those_of_one_engine():
    a, b = Recording(), Recording()
    group = EngineGroup([a, b], names=["a", "b"])
    out = group.generate(PROMPTS[:5], 3, SamplingParams(seed=100, max_new_tokens=2))
    single = Recording().generate(PROMPTS[:5], 3, SamplingParams(seed=100, max_new_tokens=2))
    assert out == single  # same prompt order, and sample k of prompt i got seed 100 + 3 i + k
    assert [c[0] for c in a.calls] == [PROMPTS[:3]] and [c[0] for c in b.calls] == [PROMPTS[3:5]]
    assert (a.calls[0][1], b.calls[0][1]) == (100, 109)


def test_fan_out_of_lifecycle_calls():
    engines = [Recording(), Recording()]
    group = EngineGroup(engines)
    group.sleep()
    group.wake()
    group.abort()
    assert group.health()
    group.shutdown()
    assert all(e.events == ["sleep", "wake", "abort", "shutdown"] for e in engines)


def test_a_failing_engine_is_named_and_the_others_aborted():
    ok, bad = Recording(), Recording(fail_generate=True)
    group = EngineGroup([ok, bad], names=["http://127.0.0.1:30000", "http://127.0.0.1:30001"])
    with pytest.raises(EngineGroupError, match=r"generate failed on rollout engine http://127.0.0.1:30001: boom"):
        group.generate(PROMPTS, 1, SamplingParams(max_new_tokens=2))


def test_a_failing_weight_update_neither_hangs_nor_hides():
    names = [f"w{i}" for i in range(100)]
    good, bad = Recording(), Recording(fail_after=3)
    group = EngineGroup([good, bad], names=["good", "bad"])
    done = threading.Event()
    err = []

    def run():
        try:
            group.update_weights((n, torch.zeros(2)) for n in names)
        except EngineGroupError as e:
            err.append(str(e))
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(30), "update_weights hung after an engine failed"
    assert err and "on rollout engine bad" in err[0] and "unknown weight 'w3'" in err[0]
    assert bad.received == names[:3] and good.received == names[: len(good.received)]


class _FinishesDuringAbort(RolloutStream):
    """One engine's stream whose pending group 0 finishes while an abort is sending its cancellations."""

    def __init__(self) -> None:
        self.queue: list[GroupRequest] = []
        self.finish, self.taken = threading.Event(), threading.Event()

    @property
    def pending(self) -> int:
        return len(self.queue)

    def submit(self, requests):
        self.queue += list(requests)

    def next(self):
        self.finish.wait(10)
        if not self.queue:
            raise GenerationAborted("aborted")
        r = self.queue.pop(0)
        return GroupResult(key=r.key, samples=[Sample(list(r.prompt_ids), [1], [-0.5], "stop")])

    def abort(self):
        self.finish.set()  # group 0 comes back as the abort goes out: the consumer may take it meanwhile
        self.taken.wait(1.0)
        keys, self.queue = [r.key for r in self.queue], []
        return AbortReport(keys=keys, tokens=0, partial={k: [] for k in keys})


def test_a_group_finished_during_an_abort_is_reported_by_it_not_delivered():
    """An abort from another thread (fully async: the publisher of newer weights) names every pending group in
    its report, with its samples; a group finishing meanwhile is not also handed to the waiting consumer."""
    inner = _FinishesDuringAbort()
    stream = GroupStream([inner], ["s0"], [1])
    stream.submit([GroupRequest(key=k, prompt_ids=[k], n=1, sampling=SamplingParams()) for k in (0, 1)])
    got: list[Any] = []

    def consume():
        try:
            got.append(stream.next())
        except GenerationAborted as e:
            got.append(e)
        inner.taken.set()

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    time.sleep(0.2)  # the consumer waits in next()
    report = stream.abort()
    consumer.join(10)
    stream.close()
    assert report.keys == [0, 1] and sorted(report.partial) == [0, 1]
    assert report.partial[0][0].response_ids == [1]
    assert len(got) == 1 and isinstance(got[0], GenerationAborted)
