"""The multi-step task (megatron_dapo.data.steps_task) and the steps base's warm-start data
(megatron_dapo.tiny.steps_data, steps_base): answers checked against an independent left-to-right
evaluator, the difficulty knob, the split, the styles and what the DAPO reward makes of them."""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest

from megatron_dapo.data import load_prompts
from megatron_dapo.data.steps_task import chain_of, make_steps_prompts, parse_chain, split_of, worked_solution
from megatron_dapo.reward.math_dapo import compute_score
from megatron_dapo.tiny import base as tiny_base
from megatron_dapo.tiny import steps_data as sd
from megatron_dapo.tiny.steps_base import steps_recipe
from megatron_dapo.tiny.tokenizer import build_char_tokenizer


def left_to_right(question: str) -> tuple[int, list[int]]:
    """An independent evaluator: the chain's value and its running values, read with a regex."""
    tokens = re.findall(r"\d+|[+\-*]", question.rstrip("="))
    value, running = int(tokens[0]), []
    for op, operand in zip(tokens[1::2], tokens[2::2]):
        value = {"+": value + int(operand), "-": value - int(operand), "*": value * int(operand)}[op]
        running.append(value)
    return value, running


def test_chains_are_correct_bounded_and_deterministic():
    prompts = make_steps_prompts(500, seed=0, min_steps=2, max_steps=5, max_value=60, max_operand=7)
    assert prompts == make_steps_prompts(500, seed=0, min_steps=2, max_steps=5, max_value=60, max_operand=7)
    assert prompts[:50] == make_steps_prompts(50, seed=0, min_steps=2, max_steps=5, max_value=60, max_operand=7)
    assert [p.messages for p in prompts] != [p.messages for p in make_steps_prompts(500, seed=1)]
    lengths: Counter = Counter()
    for i, p in enumerate(prompts):
        question = p.messages[0]["content"]
        value, running = left_to_right(question)
        assert p.ground_truth == str(value) and p.uid == f"steps/{i}" and p.data_source == "steps"
        assert all(0 <= v <= 60 for v in running)
        operands = [int(d) for d in re.findall(r"[+\-*](\d+)", question)]
        assert all(1 <= d <= 7 for d in operands)
        lengths[len(operands)] += 1
        assert parse_chain(question).question() == question
    assert set(lengths) == {2, 3, 4, 5}  # the difficulty knob: k uniform in [min_steps, max_steps]
    assert min(lengths.values()) > 80


def test_worked_solution_is_what_the_reward_reads():
    for p in make_steps_prompts(100, seed=3, max_steps=7):
        text = worked_solution(chain_of(p))
        lines = text.split("\n")
        value, running = left_to_right(p.messages[0]["content"])
        assert [int(line.split("=")[1]) for line in lines[:-1]] == running
        assert lines[-1] == f"Answer: {value}"
        assert compute_score(text, p.ground_truth).score == 1.0
    assert worked_solution(parse_chain("7+5*3-9=")) == "7+5=12\n12*3=36\n36-9=27\nAnswer: 27"
    # by hand: 20-1=19, 19+2=21, 21-4=17, 17*3=51, 51-7=44, 44*2=88 (not 20-1+2-12-14=-5: left to right)
    chain = parse_chain("20-1+2-4*3-7*2=")
    assert chain.values() == [19, 21, 17, 51, 44, 88] and chain.answer == 88


def test_spec_string_split_and_errors():
    spec = load_prompts("builtin:steps?n=40&seed=2&max_steps=3&ops=+-&max_value=50").prompts
    assert spec == make_steps_prompts(40, 2, max_steps=3, ops=("+", "-"), max_value=50)
    assert all("*" not in p.messages[0]["content"] for p in spec)
    train = load_prompts("builtin:steps?n=2000&seed=0&max_steps=2&split=train").prompts
    val = load_prompts("builtin:steps?n=300&seed=9&max_steps=2&split=val").prompts
    questions = {p.messages[0]["content"] for p in train}
    assert not questions & {p.messages[0]["content"] for p in val}  # short chains repeat; the split holds
    assert {split_of(q) for q in questions} == {"train"} and len(val) == 300
    with pytest.raises(ValueError, match="bad builtin:steps option"):
        load_prompts("builtin:steps?size=3")
    with pytest.raises(ValueError, match="must be an integer"):
        load_prompts("builtin:steps?max_steps=many")
    with pytest.raises(ValueError, match="split must be"):
        load_prompts("builtin:steps?split=test")
    for ops in ("+", "-*", "+/"):  # "-" alone would get stuck at 0, "+" alone at max_value
        with pytest.raises(ValueError, match="ops must be"):
            load_prompts(f"builtin:steps?ops={ops}")
    with pytest.raises(ValueError, match="min_steps"):
        make_steps_prompts(3, 0, min_steps=4, max_steps=2)
    with pytest.raises(ValueError, match="could not draw"):
        make_steps_prompts(500, 0, max_steps=1, max_start=2, max_value=4, max_operand=2, split="val")


def test_styles_state_the_answer_and_differ_in_length():
    tok = build_char_tokenizer(128)
    p = load_prompts("builtin:steps?n=1&seed=0&min_steps=4&max_steps=4").prompts[0]
    question, truth = p.messages[0]["content"], p.ground_truth
    texts = {s: sd.style_response(p, s, 2) for s in sd.STYLE_WEIGHTS}
    assert texts["direct"] == f"Answer: {truth}" and texts["ramble"] == f"{question}? {question}? Answer: {truth}"
    assert texts["worked"] == worked_solution(chain_of(p))
    assert texts["verify"].count("\n") == 2 * 4  # the four lines twice, then the answer
    assert {s: compute_score(t, truth).score for s, t in texts.items()} == dict.fromkeys(sd.STYLE_WEIGHTS, 1.0)
    n = {s: len(tok.encode(t, add_special_tokens=False)) for s, t in texts.items()}
    assert n["direct"] < n["worked"] < n["verify"] and n["verify"] > 2 * n["worked"] - 8
    with pytest.raises(ValueError, match="unknown style"):
        sd.style_response(p, "haiku")
    examples = sd.make_examples(tok, [p])
    assert set(examples[0].targets) == set(sd.variants())
    assert tok.decode(examples[0].targets[("verify", 1)], skip_special_tokens=True) == texts["verify"]


def test_draw_style_follows_the_weights():
    rng = random.Random(0)
    counts = Counter(sd.draw_style(rng)[0] for _ in range(4000))
    for style, weight in sd.STYLE_WEIGHTS.items():  # binomial std <= 0.008 at n=4000
        assert abs(counts[style] / 4000 - weight) < 0.03, counts


def test_length_grouped_batches_pad_less_and_keep_every_row():
    from megatron_dapo.tiny.warmstart_data import batches

    tok = build_char_tokenizer(128)
    examples = sd.make_examples(tok, make_steps_prompts(64, seed=0, max_steps=7))
    plain = batches(examples, 8, tok.pad_token_id, random.Random(0), sd.draw_style)
    grouped = batches(examples, 8, tok.pad_token_id, random.Random(0), sd.draw_style, pool=8)
    widths = {}
    for name, data in (("plain", plain), ("grouped", grouped)):
        rows = [next(data) for _ in range(8)]
        widths[name] = sum(ids.shape[1] for ids, _ in rows)
        assert sum(int((labels != -100).any(1).sum()) for _, labels in rows) == 64
    assert widths["grouped"] < 0.8 * widths["plain"]


def test_steps_recipe_fingerprint_is_its_own():
    recipe = steps_recipe()
    assert recipe.fingerprint() != tiny_base.recipe_fingerprint()
    assert recipe.fingerprint().startswith(f"{recipe.version}-")
    assert tiny_base.recipe_fingerprint() == tiny_base.arithmetic_recipe().fingerprint()
    from dataclasses import replace

    assert replace(recipe, length_pool=4).fingerprint() != recipe.fingerprint()
    assert "split=train" in recipe.train_spec and "split=val" in recipe.val_spec


@pytest.mark.slow
def test_steps_base_build_is_deterministic_and_cached(tmp_path):
    """Step-limited builds of a seed are bit-identical; ensure_steps_base reuses a current one."""
    from dataclasses import replace

    from megatron_dapo.tiny.base import build_tiny_base
    from megatron_dapo.tiny.steps_base import MAX_NEW_TOKENS, ensure_steps_base

    recipe = steps_recipe()
    recipe = replace(recipe, val_spec=recipe.val_spec.replace("n=256", "n=4"))
    weights = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        settings = replace(recipe.settings, max_steps=3, seed=seed)
        info = build_tiny_base(tmp_path / name, settings, recipe=recipe, progress=False)
        weights[name] = (tmp_path / name / "model.safetensors").read_bytes()
    assert weights["a"] == weights["b"] and weights["a"] != weights["c"]
    assert info["eval"]["max_new_tokens"] == MAX_NEW_TOKENS and info["train_prompts"] == recipe.train_spec
    assert 0 <= info["sampled_truncated"] <= 1 and 0 < info["sampled_len_mean"] <= MAX_NEW_TOKENS
    assert info["recipe_fingerprint"] == steps_recipe().fingerprint()
    stamp = (tmp_path / "a" / "model.safetensors").stat().st_mtime_ns
    assert ensure_steps_base(tmp_path / "a") == tmp_path / "a"
    assert (tmp_path / "a" / "model.safetensors").stat().st_mtime_ns == stamp


def test_the_study_prompts_are_pinned():
    """The steps base's fingerprint hashes the spec strings, not the prompts: a change of the generator
    must show here (and bump steps_base.VERSION), or cached bases would silently be stale."""
    from megatron_dapo.tiny.steps_base import VAL_SPEC

    val = [p.messages[0]["content"] for p in load_prompts(VAL_SPEC).prompts[:4]]
    assert val == ["20-1+2-4*3-7*2=", "11+8=", "7*5*2+6-3+5-1=", "5-2-2+1+2*2-7-1="]
