"""EmbeddedEngine against the transformers model it wraps: logprobs, finish reasons, weights, state."""

from typing import Any

import pytest
import torch
from support import abort_a_running_generate

from megatron_dapo.rollout import EmbeddedEngine, EngineStateError, GenerationAborted, SamplingParams
from megatron_dapo.tiny import tiny_model
from megatron_dapo.types import Sample

VOCAB = 128
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22]]
SMALL: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)


def qwen2(seed: int = 0):
    return tiny_model("qwen2", seed=seed, **SMALL)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return qwen2()


@pytest.fixture(params=[True, False], ids=["llama_decoder", "hf_decoder"])
def engine(request, model) -> EmbeddedEngine:
    return EmbeddedEngine(model, fast_path=request.param)


def teacher_forced(model, sample: Sample, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T) of each response token, from one forward over prompt + response."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(sample.prompt_ids) - 1 : -1].float()
    logprobs = (logits / (temperature or 1.0)).log_softmax(-1)
    return logprobs.gather(1, torch.tensor(sample.response_ids)[:, None]).squeeze(1)


def assert_logprobs_exact(model, sample: Sample, temperature: float = 1.0) -> None:
    ref = teacher_forced(model, sample, temperature)
    assert torch.allclose(torch.tensor(sample.rollout_logprobs), ref, atol=1e-5, rtol=0)


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def flat(groups: list[list[Sample]]) -> list[Sample]:
    return [s for g in groups for s in g]


def test_groups_shape_and_seeded_reproducibility(engine):
    sampling = SamplingParams(max_new_tokens=12, seed=3)
    a = engine.generate(PROMPTS, 3, sampling)
    b = engine.generate(PROMPTS, 3, sampling)
    c = engine.generate(PROMPTS, 3, SamplingParams(max_new_tokens=12, seed=4))
    assert [len(g) for g in a] == [3] * len(PROMPTS)
    assert all(s.prompt_ids == p for g, p in zip(a, PROMPTS) for s in g)
    assert [s.response_ids for s in flat(a)] == [s.response_ids for s in flat(b)]
    assert [s.rollout_logprobs for s in flat(a)] == [s.rollout_logprobs for s in flat(b)]
    assert [s.response_ids for s in flat(a)] != [s.response_ids for s in flat(c)]
    assert len({tuple(s.response_ids) for s in a[0]}) > 1, "the n samples of a prompt should differ"


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (0.7, 0.8), (0.0, 1.0)])
def test_logprobs_equal_teacher_forced_forward(engine, model, temperature, top_p):
    """Logprobs are of softmax(logits / T) before top-p (SGLang's default); greedy: T = 1."""
    sampling = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=16, seed=0)
    for sample in flat(engine.generate(PROMPTS, 2, sampling)):
        assert_logprobs_exact(model, sample, temperature)


def test_top_p_samples_stay_in_the_nucleus(model):
    engine = EmbeddedEngine(model)
    sampling = SamplingParams(temperature=1.0, top_p=0.3, max_new_tokens=16, seed=0)
    for sample in flat(engine.generate(PROMPTS, 4, sampling)):
        logprobs = teacher_forced(model, sample)
        ids = torch.tensor([sample.prompt_ids + sample.response_ids])
        with torch.no_grad():
            probs = model(ids).logits[0, len(sample.prompt_ids) - 1 : -1].softmax(-1)
        # a token is in the nucleus iff the mass of strictly more likely tokens is below top_p
        above = (probs * (probs > logprobs.exp()[:, None])).sum(-1)
        assert (above < 0.3 + 1e-6).all()


def test_greedy_matches_hf_generate(engine, model):
    groups = engine.generate(PROMPTS, 1, SamplingParams(temperature=0.0, max_new_tokens=10))
    for prompt, (sample,) in zip(PROMPTS, groups):
        assert sample.response_ids == hf_greedy(model, prompt, 10)
        assert sample.finish_reason == "length"


def test_left_padding_does_not_change_results(engine):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    batched = flat(engine.generate(PROMPTS, 2, greedy))
    alone = [s for p in PROMPTS for s in flat(engine.generate([p], 2, greedy))]
    assert [s.response_ids for s in batched] == [s.response_ids for s in alone]
    for a, b in zip(batched, alone):
        assert torch.allclose(torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs), atol=1e-5)


def test_sub_batches_bounded_by_max_batch_tokens(model):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    big = EmbeddedEngine(model).generate(PROMPTS, 3, greedy)
    small = EmbeddedEngine(model, max_batch_tokens=20).generate(PROMPTS, 3, greedy)  # one or two rows each
    assert [[s.response_ids for s in g] for g in big] == [[s.response_ids for s in g] for g in small]


def test_stop_token_ends_only_its_row(engine, model):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    free = [s.response_ids for s in flat(engine.generate(PROMPTS, 1, greedy))]
    stop = next(t for t in free[0][1:] if all(t not in r for r in free[1:]))
    cut = free[0].index(stop) + 1
    out = flat(engine.generate(PROMPTS, 1, SamplingParams(temperature=0.0, max_new_tokens=10,
                                                          stop_token_ids=(stop,))))
    assert out[0].response_ids == free[0][:cut] and out[0].response_ids[-1] == stop
    assert out[0].finish_reason == "stop" and not out[0].truncated
    assert len(out[0].rollout_logprobs) == cut
    assert_logprobs_exact(model, out[0])
    for sample, ref in zip(out[1:], free[1:]):
        assert sample.response_ids == ref and sample.finish_reason == "length"


def test_model_eos_stops_unless_ignored():
    model = qwen2()
    prompt = [[3, 4, 5]]
    free = EmbeddedEngine(model).generate(prompt, 1, SamplingParams(temperature=0.0, max_new_tokens=8))[0][0]
    eos = free.response_ids[2]
    model.generation_config.eos_token_id = eos
    engine = EmbeddedEngine(model)
    stopped = engine.generate(prompt, 1, SamplingParams(temperature=0.0, max_new_tokens=8))[0][0]
    assert stopped.response_ids == free.response_ids[: free.response_ids.index(eos) + 1]
    assert stopped.finish_reason == "stop"
    ignore = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    ignored = engine.generate(prompt, 1, ignore)[0][0]
    assert ignored.response_ids == free.response_ids and ignored.finish_reason == "length"


def test_rows_stopping_at_different_steps(engine, model):
    """Many stop tokens: rows finish at scattered steps and leave the batch; the rest stay exact."""
    stops = tuple(range(0, VOCAB, 9))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=30, stop_token_ids=stops, seed=1)
    samples = flat(engine.generate(PROMPTS, 4, sampling))
    assert len({s.response_len for s in samples}) > 3
    for s in samples:
        assert (s.finish_reason == "stop") == (s.response_ids[-1] in stops)
        assert not any(t in stops for t in s.response_ids[:-1])
        assert s.finish_reason == "stop" or s.response_len == 30
        assert_logprobs_exact(model, s)


def test_max_new_tokens_truncates(engine):
    for s in flat(engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=5, seed=0))):
        assert s.response_len == len(s.rollout_logprobs) == 5
        assert s.finish_reason == "length" and s.truncated


def test_update_weights_matches_second_model():
    engine, target = EmbeddedEngine(qwen2(seed=0)), qwen2(seed=1)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    before = flat(engine.generate(PROMPTS, 1, greedy))
    engine.update_weights((name, p.detach().clone()) for name, p in target.named_parameters())
    after = flat(engine.generate(PROMPTS, 1, greedy))
    assert [s.response_ids for s in after] != [s.response_ids for s in before]
    for prompt, sample in zip(PROMPTS, after):
        assert sample.response_ids == hf_greedy(target, prompt, 10)
        assert_logprobs_exact(target, sample)


def test_update_weights_rejects_unknown_name_and_bad_shape(model):
    engine = EmbeddedEngine(model)
    with pytest.raises(KeyError, match="model.layers.0.mlp.gate_proj.wieght"):
        engine.update_weights([("model.layers.0.mlp.gate_proj.wieght", torch.zeros(64, 32))])
    with pytest.raises(ValueError, match=r"model.norm.weight.*\(31,\).*\(32,\)"):
        engine.update_weights([("model.norm.weight", torch.zeros(31))])


def test_released_weights_are_lost_without_a_backup(model):
    """As CUDA's memory saver loses a paused region (SGLang without --enable-weights-cpu-backup): released
    weights come back as NaN, and only a weight update makes the engine generate as before."""
    sampling = SamplingParams(max_new_tokens=4, seed=0)
    engine = EmbeddedEngine(model)
    weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    before = engine.generate(PROMPTS, 1, sampling)
    engine.sleep()
    engine.wake()
    assert all(p.isnan().all() for p in engine.model.parameters())
    engine.update_weights(weights.items())
    assert [s.response_ids for g in engine.generate(PROMPTS, 1, sampling) for s in g] == \
        [s.response_ids for g in before for s in g]


def test_sleep_wake_shutdown(model):
    sampling = SamplingParams(max_new_tokens=4, seed=0)
    with EmbeddedEngine(model, weights_backup=True) as engine:
        engine.sleep()
        with pytest.raises(EngineStateError, match="asleep"):
            engine.generate(PROMPTS, 1, sampling)
        assert engine.health()
        engine.wake()
        assert len(engine.generate(PROMPTS, 1, sampling)) == len(PROMPTS)
    assert not engine.health()
    with pytest.raises(EngineStateError, match="shut down"):
        engine.generate(PROMPTS, 1, sampling)


def test_abort_drops_running_generate(model):
    engine = EmbeddedEngine(model)
    engine.abort()  # nothing running: no effect on the next call
    assert engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=3, seed=0))[0][0].response_len == 3
    errors = abort_a_running_generate(engine, PROMPTS, limit_s=30, poll_s=0.05)
    assert len(errors) == 1 and isinstance(errors[0], GenerationAborted)
    assert engine.generate([[1, 2]], 1, SamplingParams(max_new_tokens=3, seed=0))[0][0].response_len == 3


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_other_llama_family_models(family):
    torch.manual_seed(0)
    if family == "llama":
        model = tiny_model("llama", **SMALL)
    else:
        model = tiny_model("qwen3", **SMALL, head_dim=8)
    engine = EmbeddedEngine(model, fast_path=True)
    sampling = SamplingParams(temperature=0.8, max_new_tokens=8, seed=0)
    for sample in flat(engine.generate(PROMPTS, 2, sampling)):
        assert_logprobs_exact(model, sample, 0.8)
    greedy = engine.generate(PROMPTS[:1], 1, SamplingParams(temperature=0.0, max_new_tokens=8))[0][0]
    assert greedy.response_ids == hf_greedy(model, PROMPTS[0], 8)


def test_loads_from_hf_dir(tmp_path, model):
    model.save_pretrained(tmp_path)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    from_dir = EmbeddedEngine(tmp_path).generate(PROMPTS, 1, greedy)
    assert [s.response_ids for s in flat(from_dir)] == [hf_greedy(model, p, 6) for p in PROMPTS]


def test_invalid_requests_raise(model):
    engine = EmbeddedEngine(model)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], 1, SamplingParams())
    with pytest.raises(ValueError, match=rf"prompt 0: token ids must be in \[0, {VOCAB}\)"):
        engine.generate([[1, VOCAB]], 1, SamplingParams())
    with pytest.raises(ValueError, match="n=0"):
        engine.generate([[1]], 0, SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
