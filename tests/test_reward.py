"""Tests for megatron_dapo.reward: answer extraction/normalisation (eq. 7) and overlong shaping (eq. 13)."""

from __future__ import annotations

import ast
import pathlib
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import MATH, WRAPS

from megatron_dapo.reward import (
    RewardResult,
    compute_score,
    math_dapo,
    overlong_filter_mask,
    soft_overlong_penalty,
)
from megatron_dapo.reward.math_dapo import AnswerFallback

# ---------------------------------------------------------------- compute_score: positive cases
POSITIVE = [
    ("Answer: $13$", "13"),  # verl pain: math-wrapped Answer: line
    ("Some reasoning.\nAnswer: 13", "13"),
    ("answer: \\boxed{1,000}", "1000"),
    ("ANSWER: 1,000", "1,000"),
    ("Answer: 12 dollars", "12"),
    ("Answer: +7.", "7"),
    ("Answer: 007", "7"),
    ("Answer: 7", "007"),
    ("Answer: -0", "0"),
    ("Answer: 12.0", "12"),
    ("Answer: -1,234", "-1234"),
    ("Answer: \\text{(B)}", "(B)"),
    ("Answer: $\\frac{1}{2}$", "\\frac{1}{2}"),
    ("Answer: \\frac12", "\\frac{1}{2}"),
    ("Answer: x = 5", "5"),
    ("Answer: 90^\\circ", "90"),
    ("Answer: 1{,}000", "1000"),
    ("**Answer:** 42", "42"),
    ("**Answer**: 42", "42"),
    ("Answer:\n\n42", "42"),
    ("Answer: 42\n\nThat is all.", "42"),
    ("Answer: 5\nWait, let me recheck.\nAnswer: 6", "6"),  # last Answer wins
    ("Answer: 1234", "Natalia sold 48 clips ... #### 1,234"),  # GSM8K ground truth
    ("Answer: 72", "#### 72"),
    ("Answer: 13", "$13$"),
    ("Answer: 13", "\\boxed{13}"),
    ("Answer: 13", 13),  # integer ground truth from a parquet column
    ("Answer: \\$5", "5"),
    ("Answer: 3 hours", "3"),
    ("Answer: \\boxed{17}", "17"),  # a box on the Answer: line is the Answer: line's
]

# Wrappers real completions put around the answer, alone and nested; all mean 42.
WRAPPED_42 = [
    "\\( 42 \\)", "\\(42\\)", "\\[42\\]", "\\[ 42 \\]", "$42$", "$ 42 $", "$$42$$", "$$ 42 $$",
    "\\mathbf{42}", "\\textbf{42}", "\\text{42}", "\\mathrm{42}", "42\\%", "42%", "\\boxed{42}",
    "\\fbox{42}", "**42**", "**42**.", "$\\boxed{42}$", "\\(\\boxed{42}\\)", "\\[\\boxed{42}\\]",
    "\\boxed{\\textbf{42}}", "\\text{\\mathbf{42}}", "\\textbf{\\boxed{42}}", "$\\mathbf{42}$", "**$42$**",
    "$42\\%$", "\\(42\\%\\)", "\\boxed{42\\%}", "\\text{\\textbf{\\mathbf{42}}}\\%", "**\\boxed{42}**",
    "\\(\\text{42}\\)", "\\fbox{$42$}",
]


@pytest.mark.parametrize(("response", "truth"), POSITIVE)
@pytest.mark.parametrize("fallback", ["none", "boxed"])
def test_correct_answers_score_plus_one(response: str, truth: str, fallback: AnswerFallback) -> None:
    result = compute_score(response, truth, answer_fallback=fallback)
    assert result == RewardResult(score=1.0, acc=True, pred=result.pred)
    assert result.pred


@pytest.mark.parametrize("wrapped", WRAPPED_42)
def test_wrappers_inside_the_answer_are_normalised(wrapped: str) -> None:
    for response in (f"Answer: {wrapped}", f"**Answer:** {wrapped}", f"Answer:\n{wrapped}"):
        assert compute_score(response, "42") == RewardResult(score=1.0, acc=True, pred="42"), response
        assert not compute_score(response, "43").acc
    assert math_dapo.normalize_answer(wrapped) == "42"  # a wrapped ground truth too
    assert compute_score("Answer: 42", wrapped).acc


@pytest.mark.parametrize(
    ("answer", "pred"),
    [
        ("\\text{\\frac{1}{2}}", "\\frac{1}{2}"),  # a wrapper around braces
        ("\\mathbf{x}^{2}", "\\mathbf{x}^{2}"),  # the wrapper encloses part of the answer: as written
        ("\\text{42", "\\text{42"),  # unclosed: left alone
        ("\\{1,2\\}", "\\{1,2\\}"),  # not a wrapper
        ("4.2\\%", "4.2"),
        ("\\(x = 5\\)", "5"),
    ],
)
def test_wrapper_normalisation_details(answer: str, pred: str) -> None:
    assert math_dapo.normalize_answer(answer) == pred


# Only with answer_fallback="boxed": responses without an Answer: line.
BOXED_FALLBACK = [
    ("The final answer is \\boxed{17}.", "17", "17"),  # \boxed, no Answer: line
    ("\\boxed{3} then \\boxed{\\frac{2}{3}}", "\\frac{2}{3}", "\\frac{2}{3}"),  # last \boxed wins
    ("\\boxed{\\boxed{8}}", "8", "8"),
    ("so it is \\fbox{$\\mathbf{9}$}", "9", "9"),
    ("so the total is\n#### 42", "42", "42"),  # GSM8K-style
    ("so the total is\n#### **1,234**", "1234", "1234"),
    ("Answer:\n\\boxed{5}", "5", "5"),  # the Answer: line's next line is a box: both modes agree
]


@pytest.mark.parametrize(("response", "truth", "pred"), BOXED_FALLBACK)
def test_boxed_fallback_only_when_asked(response: str, truth: str, pred: str) -> None:
    assert compute_score(response, truth, answer_fallback="boxed") == RewardResult(1.0, True, pred)
    default = compute_score(response, truth)
    assert default == compute_score(response, truth, answer_fallback="none")
    if "Answer:" not in response:
        assert default == RewardResult(score=-1.0, acc=False, pred=None)  # DAPO: no marker, no answer


def test_shipped_prompts_ask_for_the_line_the_default_reads() -> None:
    """answer_fallback="none" suits our data: the GSM8K template and the arithmetic task ask for Answer:."""
    from megatron_dapo.data.arithmetic import format_answer
    from megatron_dapo.data.datasets import GSM8K_PROMPT_TEMPLATE

    assert "Answer:" in GSM8K_PROMPT_TEMPLATE
    assert "\\boxed" not in GSM8K_PROMPT_TEMPLATE and "####" not in GSM8K_PROMPT_TEMPLATE
    assert compute_score(f"Let me think.\n{format_answer(1234)}", "#### 1,234").acc


def test_unknown_fallback_is_an_error() -> None:
    with pytest.raises(ValueError, match="answer_fallback"):
        compute_score("Answer: 1", "1", answer_fallback="hashes")  # type: ignore[arg-type]
    assert compute_score("Answer: 1", "1", answer_fallback="none").acc  # keyword-only, positional pair kept


# ---------------------------------------------------------------- compute_score: negative cases
NEGATIVE = [
    ("The answer is 13", "13", None),  # no marker: not accepted
    ("13", "13", None),
    ("", "13", None),
    ("Answer:", "13", None),
    ("Answer: $$", "13", None),
    ("Answer: 14", "13", "14"),
    ("Answer: 13\nAnswer: 14", "13", "14"),  # last Answer wins, even when wrong
    ("Answer: 1,2", "12", "1,2"),  # not a thousands separator
    ("Answer: 12.5", "12", "12.5"),
    ("Answer: -13", "13", "-13"),
    ("\\boxed{13", "13", None),  # unbalanced box
    ("Answer: 13", "", "13"),
    ("Answer: 13", None, "13"),
    (None, "13", None),
]


@pytest.mark.parametrize(("response", "truth", "pred"), NEGATIVE)
@pytest.mark.parametrize("fallback", ["none", "boxed"])
def test_wrong_or_missing_answers_score_minus_one(response: str, truth: str, pred: str | None,
                                                  fallback: AnswerFallback) -> None:
    result = compute_score(response, truth, answer_fallback=fallback)
    assert result == RewardResult(score=-1.0, acc=False, pred=pred)


@pytest.mark.parametrize(
    ("response", "pred"),
    [
        ("Answer: 1\n\\boxed{2}\n#### 3", "1"),  # Answer: beats \boxed beats ####
        ("\\boxed{2}\n#### 3", "2"),
        ("#### 3", "3"),
        ("Answer: $$\n\\boxed{2}", "2"),  # empty Answer: line falls through
    ],
)
def test_extraction_precedence_with_boxed_fallback(response: str, pred: str) -> None:
    assert math_dapo.extract_answer(response, "boxed") == pred
    expected = "1" if response.startswith("Answer: 1") else None  # "none": the Answer: line or nothing
    assert math_dapo.extract_answer(response) == expected


def test_result_is_frozen() -> None:
    result = compute_score("Answer: 1", "1")
    with pytest.raises(AttributeError):
        result.score = 0.0  # type: ignore[misc]


@pytest.mark.parametrize("marker", ["Answer: 13", "\\boxed{13}", "#### 13"])
def test_marker_must_be_in_tail(marker: str) -> None:
    far = marker + "\n" + "x" * (math_dapo.SEARCH_TAIL_CHARS + 10)
    assert compute_score(far, "13", answer_fallback="boxed").pred is None


def test_huge_ground_truth_never_matches() -> None:
    truth = "1" * (math_dapo.MAX_TRUTH_CHARS + 1)
    assert not compute_score(f"Answer: {truth}", truth).acc


# ---------------------------------------------------------------- robustness and bounded work
ADVERSARIAL = [
    "\\boxed{" * 700_000,
    "{" * 5_000_000,
    "}" * 5_000_000,
    "Answer:" * 700_000,
    "####" * 1_250_000,
    "$" * 5_000_000,
    "a" * 5_000_000 + "Answer: 5",
    ("\\boxed{" * 50_000 + "}" * 50_000) * 10,
    "\ud800" * 5_000_000,
    "=" * 5_000_000,
    "Answer: " + "\\text{" * 40 + "9" * 5_000_000,
    "\\mathbf{" * 1_000_000,
    "Answer: " + "\\text{\\mathbf{" * 20 + "}" * 40,
    ("\\(" + "%" * 10 + "\\)") * 300_000,
    "*" * 5_000_000,
]


@pytest.mark.parametrize("response", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
@pytest.mark.parametrize("fallback", ["none", "boxed"])
def test_adversarial_inputs_finish_quickly(response: str, fallback: AnswerFallback) -> None:
    start = time.perf_counter()
    result = compute_score(response, response, answer_fallback=fallback)
    elapsed = time.perf_counter() - start
    assert result.score in (1.0, -1.0)
    assert elapsed < 2.0, f"took {elapsed:.2f}s"  # hang guard, not a benchmark


def test_truth_of_maximal_length_with_nested_wrappers_is_quick() -> None:
    depth = (math_dapo.MAX_TRUTH_CHARS - 2) // 10
    truth = "\\mathbf{" * depth + "7" + "}" * depth  # 10k chars, 1000 nested wrappers
    assert len(truth) <= math_dapo.MAX_TRUTH_CHARS
    start = time.perf_counter()
    assert math_dapo.normalize_answer(truth) == "7"
    assert compute_score("Answer: 7", truth).acc
    assert time.perf_counter() - start < 2.0


def test_trailing_answer_after_junk_is_found() -> None:
    assert compute_score("a" * 5_000_000 + "\nAnswer: 5", "5").acc


FRAGMENTS = st.sampled_from(
    ["Answer:", "answer :", "\\boxed{", "\\fbox{", "{", "}", "$", "####", "\n", " ", "=", ",",
     "\\text{", "\\frac", "sqrt", "-", "+", ".", "0", "7", "13", "1,000", "dollars", "\ud800", "*",
     "\\(", "\\)", "\\[", "\\]", "\\mathbf{", "\\textbf{", "\\mathrm{", "%", "\\%", "**"]
)
FALLBACKS = st.sampled_from(["none", "boxed"])
JUNK = st.one_of(
    st.text(),
    st.text(alphabet=st.characters(exclude_categories=())),  # includes lone surrogates
    st.binary().map(lambda b: b.decode("utf-8", errors="replace")),
    st.binary().map(lambda b: b.decode("utf-8", errors="surrogateescape")),
    st.lists(FRAGMENTS, max_size=60).map("".join),
)


def _check(result: RewardResult) -> None:
    assert isinstance(result, RewardResult)
    assert result.score in (1.0, -1.0)
    assert result.acc == (result.score == 1.0)
    assert result.pred is None or (isinstance(result.pred, str) and result.pred)


@settings(max_examples=300, deadline=None)
@given(response=JUNK, truth=JUNK, fallback=FALLBACKS)
def test_fuzz_never_raises(response: str, truth: str, fallback: AnswerFallback) -> None:
    _check(compute_score(response, truth, answer_fallback=fallback))


@settings(max_examples=100, deadline=None)
@given(junk=JUNK, n=st.integers(min_value=-(10**60), max_value=10**60), fallback=FALLBACKS)
def test_fuzz_integer_answer_is_recognised(junk: str, n: int, fallback: AnswerFallback) -> None:
    result = compute_score(f"{junk}\nAnswer: {n}", str(n), answer_fallback=fallback)
    assert result.acc and result.score == 1.0
    assert compute_score(f"Answer: {n}", str(n + 1), answer_fallback=fallback).score == -1.0


@settings(max_examples=200, deadline=None)
@given(
    junk=JUNK,
    n=st.integers(min_value=-(10**12), max_value=10**12),
    wraps=st.lists(st.sampled_from(WRAPS), max_size=4),
    math=st.tuples(st.sampled_from(MATH), st.integers(0, 4)) | st.none(),
    fallback=FALLBACKS,
)
def test_fuzz_wrapped_integer_answer_is_recognised(junk: str, n: int, wraps: list, math, fallback) -> None:
    if math is not None:
        wraps.insert(min(math[1], len(wraps)), math[0])
    answer = str(n)
    for opening, closing in wraps:
        answer = opening + answer + closing
    result = compute_score(f"{junk}\nAnswer: {answer}", str(n), answer_fallback=fallback)
    assert result.acc, answer
    assert not compute_score(f"Answer: {answer}", str(n + 1), answer_fallback=fallback).acc


@settings(max_examples=100, deadline=None)
@given(n=st.integers(min_value=0, max_value=10**12))
def test_fuzz_thousands_separators(n: int) -> None:
    assert compute_score(f"Answer: {n:,}", str(n)).acc
    assert compute_score(f"Answer: {n}", f"#### {n:,}").acc


def test_reward_package_imports_no_heavy_deps() -> None:
    """Only the standard library, and the optional math-verify lazily (inside a function) where it is used."""
    allowed = {"__future__", "dataclasses", "logging", "re", "math", "operator", "sys",
               "collections", "typing", "megatron_dapo", "functools", "importlib", "signal", "threading"}
    lazy = {"math_verify_reward.py": {"math_verify"}}
    for path in pathlib.Path(math_dapo.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        top_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and id(node) not in top_level:
                roots = {alias.name.split(".")[0] for alias in node.names} - lazy.get(path.name, set())
                assert roots <= allowed, f"{path.name} imports {roots - allowed}"
                continue
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {(node.module or "").split(".")[0]}
            else:
                continue
            assert roots <= allowed, f"{path.name} imports {roots - allowed}"


# ---------------------------------------------------------------- soft overlong penalty (eq. 13)
@pytest.mark.parametrize(
    ("length", "expected"),
    [(0, 0.0), (16384, 0.0), (16385, -1 / 4096), (18432, -0.5), (20479, -4095 / 4096),
     (20480, -1.0), (20481, -1.0), (10**9, -1.0)],
)
def test_soft_overlong_penalty_paper_setting(length: int, expected: float) -> None:
    assert soft_overlong_penalty(length, 20480, 4096) == pytest.approx(expected, abs=0, rel=1e-12)


def test_soft_overlong_penalty_factor_scales() -> None:
    assert soft_overlong_penalty(18432, 20480, 4096, factor=0.5) == pytest.approx(-0.25)
    assert soft_overlong_penalty(30000, 20480, 4096, factor=2.0) == -2.0
    assert soft_overlong_penalty(100, 20480, 4096, factor=2.0) == 0.0
    assert soft_overlong_penalty(9, 10, 4) == pytest.approx(-0.75)  # (6 - 9) / 4


@pytest.mark.parametrize(
    ("args", "name"),
    [((10, 100, 0), "cache_len"), ((10, 100, 100), "cache_len"), ((10, 100, -1), "cache_len"),
     ((-1, 100, 10), "length"), ((10, 0, 10), "max_response_len"),
     ((10, 100, 10, -1.0), "factor"), ((10, 100, 10, float("nan")), "factor")],
)
def test_soft_overlong_penalty_rejects_bad_args(args: tuple, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        soft_overlong_penalty(*args)


def test_soft_overlong_penalty_rejects_non_ints() -> None:
    with pytest.raises(TypeError, match="length"):
        soft_overlong_penalty(1.5, 100, 10)  # type: ignore[arg-type]


# ---------------------------------------------------------------- overlong filtering mask
def test_overlong_filter_mask_list() -> None:
    assert overlong_filter_mask([True, False, False, True]) == [0.0, 1.0, 1.0, 0.0]
    assert overlong_filter_mask([]) == []


def test_overlong_filter_mask_tensor() -> None:
    torch = pytest.importorskip("torch")
    mask = overlong_filter_mask(torch.tensor([True, False, True]))
    assert mask.dtype == torch.float32
    assert mask.tolist() == [0.0, 1.0, 0.0]
    assert overlong_filter_mask(torch.tensor([0, 2])).tolist() == [1.0, 0.0]
