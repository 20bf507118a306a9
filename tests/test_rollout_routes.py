"""The embedded engine reports a mixture-of-experts model's routing (SamplingParams.return_routes, SGLang's
return_routed_experts): for every token it read, prompt and response, the experts each layer's router picked.
Reference: transformers' own routers over the whole sample in one forward (no cache, no padding, no batch)."""

from __future__ import annotations

import pytest
import torch
from support import forward_routes

from megatron_dapo.rollout.base import GroupRequest, SamplingParams
from megatron_dapo.rollout.embedded.engine import EmbeddedEngine
from megatron_dapo.tiny import tiny_model

PROMPTS = [[5, 9, 3, 7, 11, 2, 8], [4, 6], [10, 12, 14, 3, 1]]


def _check(model, samples, *, top_k: int) -> int:
    """Every sample's routes equal the reference's where the choice is not a near-tie; returns positions checked."""
    checked = 0
    for s in samples:
        ids = s.prompt_ids + s.response_ids
        assert s.routes is not None and s.routes.dtype == torch.uint8
        assert tuple(s.routes.shape) == (len(ids) - 1, len(model.model.layers), top_k)
        ref, gap = forward_routes(model, ids)
        clear = gap[: len(ids) - 1] > 1e-4
        same = (s.routes.long().sort(-1).values == ref[: len(ids) - 1].sort(-1).values).all(-1)
        assert bool(same[clear].all()), (s.routes, ref)
        checked += int(clear.sum())
    return checked


@pytest.fixture(scope="module")
def moe():
    return tiny_model("qwen3_moe", seed=0)


def test_generate_reports_every_read_tokens_experts(moe):
    engine = EmbeddedEngine(moe)
    out = engine.generate(PROMPTS, 3, SamplingParams(temperature=1.0, max_new_tokens=9, seed=3, return_routes=True))
    samples = [s for group in out for s in group]
    assert {s.finish_reason for s in samples} <= {"stop", "length"}
    assert _check(moe, samples, top_k=moe.config.num_experts_per_tok) > 0.9 * sum(
        len(s.prompt_ids) + s.response_len - 1 for s in samples) * len(moe.model.layers)
    plain = engine.generate(PROMPTS, 3, SamplingParams(temperature=1.0, max_new_tokens=9, seed=3))
    assert all(s.routes is None for g in plain for s in g)
    assert [[s.response_ids for s in g] for g in plain] == [[s.response_ids for s in g] for g in out]


def test_a_stream_reports_them_too(moe):
    engine = EmbeddedEngine(moe)
    stream = engine.stream()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=7, seed=11, return_routes=True)
    stream.submit([GroupRequest(key=i, prompt_ids=p, n=2, sampling=sampling) for i, p in enumerate(PROMPTS)])
    samples = [s for _ in PROMPTS for s in stream.next().samples]
    stream.close()
    assert _check(moe, samples, top_k=moe.config.num_experts_per_tok) > 0


def test_a_dense_model_has_no_routes():
    out = EmbeddedEngine(tiny_model("qwen3", seed=0)).generate(
        PROMPTS[:1], 1, SamplingParams(max_new_tokens=4, seed=1, return_routes=True))
    assert out[0][0].routes is None


def test_the_process_engine_brings_them_back_from_its_child(moe, tmp_path):
    """rollout.colocate=false: the engine's child process records the routes and they cross the pipe intact."""
    from megatron_dapo.rollout.embedded.process_engine import ProcessEngine

    moe.save_pretrained(tmp_path)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=5, return_routes=True)
    with ProcessEngine(tmp_path, threads=1) as engine:
        remote = engine.generate(PROMPTS, 2, sampling)
    local = EmbeddedEngine(moe).generate(PROMPTS, 2, sampling)
    for a, b in zip((s for g in remote for s in g), (s for g in local for s in g)):
        assert a.response_ids == b.response_ids and torch.equal(a.routes, b.routes)


def test_a_resumed_sample_keeps_its_carried_routes_and_routes_the_rest_anew(moe):
    """Partial rollout with r3: an aborted sample hands back its routes so far; resumed on other weights, the
    positions before its last carried token keep them (the weights that generated those tokens routed them) and the
    rest are the new weights' routes."""
    import copy
    import dataclasses

    top_k = moe.config.num_experts_per_tok
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12, seed=7, return_routes=True, ignore_eos=True)
    stream = EmbeddedEngine(moe).stream()
    short = dataclasses.replace(sampling, max_new_tokens=4)  # group 0 ends while the others are a third of the way
    stream.submit([GroupRequest(key=i, prompt_ids=p, n=2, sampling=short if i == 0 else sampling)
                   for i, p in enumerate(PROMPTS)])
    assert stream.next().key == 0
    report = stream.abort()
    stream.close()
    cut = [s for k in report.keys for s in report.partial[k] if 0 < s.response_len < 12]
    assert cut, "no sample was cut mid-way"
    assert _check(moe, cut, top_k=top_k) > 0  # an aborted sample's routes: every position it read

    newer = copy.deepcopy(moe)
    torch.manual_seed(1)
    for layer in newer.model.layers:
        layer.mlp.gate.weight.data = torch.randn_like(layer.mlp.gate.weight)
    stream = EmbeddedEngine(newer).stream()
    stream.submit([GroupRequest(key=k, prompt_ids=PROMPTS[k], n=2, sampling=sampling,
                                resume=tuple(report.partial[k])) for k in report.keys])
    resumed = {}
    while stream.pending:
        got = stream.next()
        resumed[got.key] = got.samples
    stream.close()
    differs = 0
    for k in report.keys:
        for before, after in zip(report.partial[k], resumed[k]):
            if not 0 < before.response_len < 12:
                continue
            kept = len(before.prompt_ids) + before.response_len - 1
            assert after.response_ids[: before.response_len] == before.response_ids
            assert torch.equal(after.routes[:kept], before.routes)
            ids = after.prompt_ids + after.response_ids
            ref, gap = forward_routes(newer, ids)
            clear = gap[kept: len(ids) - 1] > 1e-4
            same = (after.routes[kept:].long().sort(-1).values == ref[kept: len(ids) - 1].sort(-1).values).all(-1)
            assert bool(same[clear].all()) and int(clear.sum()) > 0
            differs += int((ref[:kept].sort(-1).values != before.routes.long().sort(-1).values).any())
    assert differs, "the new weights route the carried positions as the old did: the test cannot tell them apart"
