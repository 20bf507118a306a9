"""Streaming rollout engines (embedded continuous batching, engine groups): each group's samples against
a teacher-forced transformers forward, their independence from what else runs, slot refill, abort."""

import math
import threading
import time
from typing import Any

import pytest
import torch
from support import FailingEngine

from megatron_dapo.rollout import EmbeddedEngine, EngineStateError, GenerationAborted, SamplingParams
from megatron_dapo.rollout.base import GroupRequest, RolloutEngine, RolloutStream
from megatron_dapo.rollout.engine_group import EngineGroup
from megatron_dapo.rollout.group_stream import EngineGroupFailure
from megatron_dapo.rollout.embedded.sampling import counter_uniforms
from megatron_dapo.tiny import tiny_model

VOCAB = 128
SMALL: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22], [30], [40, 41, 42, 43]]
STOPS = tuple(range(3, VOCAB, 11))  # many stop tokens: rows end at scattered steps


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=0, **SMALL)


def requests(prompts=PROMPTS, n=3, max_new=20, seed=100, **kw) -> list[GroupRequest]:
    return [GroupRequest(key=g, prompt_ids=p, n=n, sampling=SamplingParams(
        max_new_tokens=max_new, stop_token_ids=STOPS, seed=seed + 1000 * g, **kw)) for g, p in enumerate(prompts)]


def drain(stream: RolloutStream) -> dict:
    out = {}
    while stream.pending:
        result = stream.next()
        assert result.key not in out
        out[result.key] = result.samples
    return out


def run(engine: RolloutEngine, reqs: list[GroupRequest]) -> dict:
    with engine.stream() as stream:
        stream.submit(reqs)
        return drain(stream)


def teacher_forced(model, sample, temperature: float = 1.0) -> torch.Tensor:
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(sample.prompt_ids) - 1: -1].float()
    return (logits / temperature).log_softmax(-1).gather(1, torch.tensor(sample.response_ids)[:, None]).squeeze(1)


def assert_same(a: dict, b: dict) -> None:
    """Identical tokens and finish reasons; logprobs equal to float rounding of batched matmuls."""
    assert a.keys() == b.keys()
    for key in a:
        assert [s.response_ids for s in a[key]] == [s.response_ids for s in b[key]], key
        assert [s.finish_reason for s in a[key]] == [s.finish_reason for s in b[key]]
        for x, y in zip(a[key], b[key]):
            assert torch.allclose(torch.tensor(x.rollout_logprobs), torch.tensor(y.rollout_logprobs), atol=1e-5)


def test_counter_uniforms_are_pure_and_uniform():
    keys = torch.arange(20000, dtype=torch.long) * 7919 + (1 << 40)
    counters = torch.arange(20000) % 97
    u = counter_uniforms(keys, counters)
    assert u.shape == (20000, 1) and (u >= 0).all() and (u < 1).all()
    assert torch.equal(u[5:9], counter_uniforms(keys[5:9], counters[5:9]))  # per row: no batch dependence
    assert not torch.equal(counter_uniforms(keys, counters + 1), u)
    # Kolmogorov-Smirnov against U(0, 1): the 1% critical value is 1.63 / sqrt(n)
    ranked = u.squeeze(1).sort().values.double()
    ks = (ranked - torch.arange(1, 20001, dtype=torch.double) / 20000).abs().max()
    assert ks < 1.63 / math.sqrt(20000)
    lag = u.squeeze(1)
    assert abs(torch.corrcoef(torch.stack([lag[:-1], lag[1:]]))[0, 1]) < 0.03


@pytest.mark.parametrize("top_p", [1e-6, 0.3, 0.7, 0.95, 0.999999])
def test_the_nucleus_is_transformers_top_p_set(top_p):
    """sampling.nucleus (a top-k search) keeps TopPLogitsWarper's tokens (a full sort): rows from nearly uniform to
    peaked over a 49k vocabulary, where the set needs the first 64 candidates, more, or all. Against a float64
    oracle of the rule and against the warper, a token may differ only where its mass (it and every less probable
    token) is within float32 rounding of 1 - top_p."""
    from transformers.generation.logits_process import TopPLogitsWarper

    from megatron_dapo.rollout.embedded.sampling import nucleus

    g = torch.Generator().manual_seed(0)
    scale = torch.tensor([0.05, 0.5, 2.0, 5.0, 12.0]).repeat_interleave(4)[:, None]
    quantiles = torch.special.ndtri((torch.arange(49152) + 0.5) / 49152)  # distinct: no tie decides the set
    logits = quantiles[torch.stack([torch.randperm(49152, generator=g) for _ in range(20)])] * scale
    kept = nucleus(logits.softmax(-1), top_p)
    exact = logits.double().softmax(-1)
    order = exact.argsort(-1)  # ascending
    mass = torch.empty_like(exact).scatter_(1, order, exact.gather(1, order).cumsum(-1))
    oracle = mass > 1 - top_p
    oracle[torch.arange(20), exact.argmax(-1)] = True
    near = (mass - (1 - top_p)).abs() <= 1e-6 * (1 - top_p) + 1e-9
    warper = torch.isfinite(TopPLogitsWarper(top_p)(None, logits))
    for other in (oracle, warper):
        assert not ((kept != other) & ~near).any(), ((kept != other) & ~near).sum(-1)
    assert torch.equal(kept.sum(-1)[:12], oracle.sum(-1)[:12]) or top_p == 0.999999  # most rows: the very set
    assert kept.any(-1).all() and int(near.sum()) <= 40


@pytest.mark.parametrize("fast", [True, False], ids=["slot_decoder", "wave_decoder"])
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8), (0.0, 1.0)])
def test_stream_samples_are_exact(model, fast, temperature, top_p):
    """Logprobs = log softmax(logits / T) of a teacher-forced forward; stop tokens end only their row."""
    engine = EmbeddedEngine(model, fast_path=fast, max_batch_tokens=8 * 40)  # 8 rows: groups queue
    out = run(engine, requests(temperature=temperature, top_p=top_p))
    assert sorted(out) == list(range(len(PROMPTS)))
    for key, samples in out.items():
        assert len(samples) == 3 and all(s.prompt_ids == PROMPTS[key] for s in samples)
        for s in samples:
            assert (s.finish_reason == "stop") == (s.response_ids[-1] in STOPS)
            assert s.finish_reason == "stop" or s.response_len == 20
            assert not any(t in STOPS for t in s.response_ids[:-1])
            ref = teacher_forced(model, s, temperature or 1.0)
            assert torch.allclose(torch.tensor(s.rollout_logprobs), ref, atol=1e-5, rtol=0)
    lengths = {s.response_len for g in out.values() for s in g}
    assert len(lengths) > 3 or temperature == 0.0


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2_moe"])
def test_other_families_stream_exactly(family):
    kw: dict[str, Any] = dict(SMALL, head_dim=8) if family == "qwen3" else SMALL
    model = tiny_model(family, seed=0, **kw)
    out = run(EmbeddedEngine(model, max_batch_tokens=6 * 40), requests(PROMPTS[:3], temperature=0.8))
    for s in (s for g in out.values() for s in g):
        assert torch.allclose(torch.tensor(s.rollout_logprobs), teacher_forced(model, s, 0.8), atol=1e-5, rtol=0)


def test_a_group_does_not_depend_on_its_batch(model):
    """Each group alone, all together, in a tiny KV budget (rows queue and reuse slots), in reverse order:
    the same samples, which a group's seed alone decides (sample k draws from seed + k)."""
    reqs = requests()
    together = run(EmbeddedEngine(model), reqs)
    alone = {k: v for r in reqs for k, v in run(EmbeddedEngine(model), [r]).items()}
    squeezed = run(EmbeddedEngine(model, max_batch_tokens=3 * 40), reqs[::-1])
    assert_same(together, alone)
    assert_same(together, squeezed)
    single = GroupRequest(key=0, prompt_ids=PROMPTS[0], n=1, sampling=SamplingParams(
        max_new_tokens=20, stop_token_ids=STOPS, seed=101))
    assert run(EmbeddedEngine(model), [single])[0][0].response_ids == together[0][1].response_ids  # seed 100 + 1
    other = run(EmbeddedEngine(model), requests(seed=7))
    assert [s.response_ids for s in other[0]] != [s.response_ids for s in together[0]]


def test_length_buckets_keep_the_padding_under_the_real_positions():
    from megatron_dapo.rollout.embedded.slots import length_buckets

    lengths = [20, 280, 25, 150, 141, 12]
    buckets = length_buckets(lengths)
    assert buckets == [[1, 3, 4], [2, 0], [5]]  # 280, 150, 141 | 25, 20 | 12 (12 is not over 25 / 2)
    for b in buckets:
        width = max(lengths[i] for i in b)
        assert len(b) * width - sum(lengths[i] for i in b) < sum(lengths[i] for i in b)
    assert length_buckets([7, 7, 4]) == [[0, 1, 2]] and length_buckets([5]) == [[0]]


def test_an_admission_of_mixed_lengths_prefills_by_length(model, monkeypatch):
    """A 40-token row (a carried response) and short prompts prefill apart, not as 40-wide rows; every new
    row's logits, before and after one decode step, are those of a plain forward over that row alone."""
    from megatron_dapo.rollout.embedded.decoders import LlamaDecoder
    from megatron_dapo.rollout.embedded.slots import SlotDecoder

    widths = []
    real_forward = LlamaDecoder._forward

    def forward(self, ids, *a, **k):
        widths.append(tuple(ids.shape))
        return real_forward(self, ids, *a, **k)

    monkeypatch.setattr(LlamaDecoder, "_forward", forward)
    prompts = [[3, 1, 4], list(range(1, 41)), [7, 8]]
    rows = [prompts[0], prompts[1], prompts[1], prompts[2]]  # copies 1, 2, 1: prompt-major
    decoder = SlotDecoder(model, budget_tokens=8 * 64)
    decoder.reserve(48, 6)
    with torch.no_grad():
        decoder.admit([[5, 6]], [1])  # a running row first: the new rows go after it
        first = decoder.admit(prompts, [1, 2, 1])
        nxt = torch.tensor([9, 11, 12, 13])
        after = decoder.step(torch.cat([torch.tensor([2]), nxt]))[1:]
        ref = torch.stack([model(torch.tensor([r])).logits[0, -1] for r in rows])
        ref_after = torch.stack([model(torch.tensor([r + [t]])).logits[0, -1]
                                 for r, t in zip(rows, nxt.tolist())])
    assert widths[1:3] == [(1, 40), (2, 3)]
    assert decoder.rows == 5 and decoder.lens[:5].tolist() == [3, 4, 41, 41, 3]
    assert torch.allclose(first, ref, atol=1e-5) and torch.allclose(after, ref_after, atol=1e-5)


def test_the_next_stream_reuses_the_kv_memory(model):
    engine = EmbeddedEngine(model)
    first = run(engine, requests())
    kept = engine._spare
    assert kept is not None and kept.rows == 0 and kept.slots > 0
    second = run(engine, requests()[::-1])
    assert engine._spare is kept
    assert_same(first, second)


def test_finished_rows_are_refilled_at_once(model, monkeypatch):
    """Continuous batching: a row that finishes at one step is replaced at the next; while rows wait,
    every step samples a full batch of slots."""
    from megatron_dapo.rollout.embedded.continuous import EmbeddedStream

    seen = []  # (running rows, slots, rows still waiting) after each admission
    real_admit = EmbeddedStream._admit

    def admit(self):
        real_admit(self)
        seen.append((self._decoder.rows, self._decoder.slots, len(self._waiting)))

    monkeypatch.setattr(EmbeddedStream, "_admit", admit)
    out = run(EmbeddedEngine(model, max_batch_tokens=4 * 64), requests(max_new=30))  # 4 slots of 64 tokens
    assert len(out) == len(PROMPTS)
    assert {slots for _, slots, _ in seen} == {4}
    busy = [(rows, waiting) for rows, _, waiting in seen if waiting]
    assert len(busy) > 20 and all(rows == 4 for rows, _ in busy), busy
    assert seen[-1][0] < 4  # the tail: nothing left to admit


def test_per_group_limits_and_eos():
    """max_new_tokens and ignore_eos are per group; the model's EOS stops a row unless ignored."""
    model = tiny_model("qwen2", seed=0, **SMALL)
    free = GroupRequest(key=1, prompt_ids=[1, 2], n=2, sampling=SamplingParams(max_new_tokens=40, seed=1,
                                                                                ignore_eos=True))
    ref = run(EmbeddedEngine(model), [free])[1][0].response_ids
    model.generation_config.eos_token_id = ref[10]
    engine = EmbeddedEngine(model)
    reqs = [GroupRequest(key=0, prompt_ids=[1, 2], n=2, sampling=SamplingParams(max_new_tokens=40, seed=1)), free]
    out = run(engine, reqs)
    assert out[0][0].response_ids == ref[: ref.index(ref[10]) + 1] and out[0][0].finish_reason == "stop"
    assert out[1][0].response_ids == ref and all(s.response_len == 40 for s in out[1])
    short = GroupRequest(key=2, prompt_ids=[1, 2], n=2, sampling=SamplingParams(max_new_tokens=4, seed=1,
                                                                                 ignore_eos=True))
    assert run(engine, [short])[2][0].response_ids == ref[:4]
    with pytest.raises(ValueError, match="temperature/top_p"):
        with engine.stream() as stream:
            stream.submit([reqs[0], GroupRequest(key=2, prompt_ids=[3], n=1, sampling=SamplingParams(temperature=0.5))])
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.stream().submit([GroupRequest(key=0, prompt_ids=[VOCAB], n=1, sampling=SamplingParams())])
    with pytest.raises(ValueError, match="n=0"):
        GroupRequest(key=0, prompt_ids=[1], n=0, sampling=SamplingParams())


def test_abort_reports_what_it_cancelled_and_the_stream_goes_on(model):
    engine = EmbeddedEngine(model, max_batch_tokens=6 * 64)  # 6 rows run, the others wait
    reqs = requests(max_new=60)
    with engine.stream() as stream:
        stream.submit(reqs)
        first = stream.next()
        running = sum(len(r.tokens) for r in stream._rows)
        finished = sum(s.response_len for g in stream._groups.values() for s in g.samples if s is not None)
        report = stream.abort()
        assert report.keys == sorted(set(range(len(PROMPTS))) - {first.key})
        assert report.tokens == running + finished > 0
        assert stream.pending == 0
        with pytest.raises(EngineStateError, match="no group is pending"):
            stream.next()
        stream.submit(reqs[:2])  # usable again, with the same keys
        again = drain(stream)
    assert_same(again, run(EmbeddedEngine(model), reqs[:2]))
    assert engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=3, seed=0))[0][0].response_len == 3


def test_abort_from_another_thread_stops_next(model):
    engine = EmbeddedEngine(model)
    stream = engine.stream()
    stream.submit([GroupRequest(key=0, prompt_ids=[1, 2], n=2, sampling=SamplingParams(
        max_new_tokens=100000, ignore_eos=True, seed=0))])
    errors = []
    thread = threading.Thread(target=lambda: errors.append(pytest.raises(GenerationAborted, stream.next)))
    thread.start()
    time.sleep(0.5)
    report = stream.abort()
    thread.join(30)
    assert not thread.is_alive() and len(errors) == 1
    assert report.keys == [0] and report.tokens > 0


def test_asleep_engine_refuses_to_step(model):
    engine = EmbeddedEngine(model, weights_backup=True)  # (without the backup its weights come back lost)
    stream = engine.stream()
    stream.submit(requests()[:1])
    engine.sleep()
    with pytest.raises(EngineStateError, match="asleep"):
        stream.next()
    engine.wake()
    assert stream.next().key == 0


def test_engine_group_streams_by_load_and_keeps_each_group(model):
    reqs = requests()
    one = run(EmbeddedEngine(model), reqs)
    engines = [EmbeddedEngine(tiny_model("qwen2", seed=0, **SMALL)) for _ in range(2)]
    with EngineGroup(engines, names=["a", "b"]) as group:
        with group.stream() as stream:
            stream.submit(reqs)
            owners = dict(stream._owner)  # type: ignore[attr-defined]  # an EngineGroup's stream
            many = drain(stream)
            assert stream.pending == 0
    assert_same(one, many)
    assert sorted(owners.values()) == [0, 0, 0, 1, 1, 1]  # spread by pending groups


def endless() -> list[GroupRequest]:
    return [GroupRequest(key=g, prompt_ids=p, n=3, sampling=SamplingParams(
        max_new_tokens=100000, ignore_eos=True, seed=g)) for g, p in enumerate(PROMPTS)]


@pytest.mark.timeout(120)  # a regression hangs in abort()
def test_a_nested_group_aborts_and_streams_on(model):
    """A group inside a group (rank 0 drives its own server and an attached node group): the outer
    group's thread for the inner one waits in the inner next(). abort() must end that wait with
    GenerationAborted (it used to wait forever, and so did abort()), and the streams go on."""
    reqs = requests(max_new=20)
    one = run(EmbeddedEngine(model), reqs)
    small = [EmbeddedEngine(tiny_model("qwen2", seed=0, **SMALL)) for _ in range(3)]
    with EngineGroup([small[0], EngineGroup(small[1:], names=["b", "c"])], names=["a", "bc"],
                     weights=[1, 2]) as group:
        with group.stream() as stream:
            stream.submit(endless())  # nothing finishes before the abort
            time.sleep(0.5)
            reports = []
            aborter = threading.Thread(target=lambda: reports.append(stream.abort()), daemon=True)
            aborter.start()
            aborter.join(60)
            assert not aborter.is_alive(), "abort() hangs on the nested group"
            assert reports[0].keys == list(range(len(PROMPTS))) and reports[0].tokens > 0
            assert sorted(reports[0].partial) == reports[0].keys
            stream.submit(reqs)
            assert_same(one, drain(stream))
        inner = group.engines[1].stream()
        inner.submit(endless()[:2])
        errors = []
        waiter = threading.Thread(target=lambda: errors.append(pytest.raises(GenerationAborted, inner.next)),
                                  daemon=True)
        waiter.start()
        time.sleep(0.5)
        assert inner.abort().keys == [0, 1]
        waiter.join(30)
        assert not waiter.is_alive() and len(errors) == 1
        inner.close()


def test_a_failing_engine_is_named_and_the_stream_still_aborts(model):
    bad = FailingEngine(good=1)
    group = EngineGroup([bad, EmbeddedEngine(model)], names=["http://bad:1", "embedded"])
    stream = group.stream()
    stream.submit(requests(max_new=8))
    got, error = [], None
    while stream.pending and error is None:
        try:
            got.append(stream.next().key)
        except EngineGroupFailure as e:
            error = e
    assert error is not None and "http://bad:1" in str(error) and "connection refused" in str(error)
    assert 0 in got and 2 not in got  # the failing engine's first group comes through, its second never
    report = stream.abort()
    assert set(report.keys) | set(got) == set(range(len(PROMPTS))) and bad.streams[0].aborted
    stream.submit([r for r in requests(max_new=8) if r.key not in got][:1])  # only the live engine takes it
    assert stream.next().samples
    stream.close()
