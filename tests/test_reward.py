"""Tests for megatron_dapo.reward: answer extraction/normalisation (eq. 7) and overlong shaping (eq. 13)."""

from __future__ import annotations

import ast
import pathlib
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dapo.reward import (
    RewardResult,
    compute_score,
    math_dapo,
    overlong_filter_mask,
    soft_overlong_penalty,
)

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
    ("The final answer is \\boxed{17}.", "17"),  # \boxed fallback, no Answer: line
    ("\\boxed{3} then \\boxed{\\frac{2}{3}}", "\\frac{2}{3}"),  # last \boxed wins
    ("\\boxed{\\boxed{8}}", "8"),
    ("so the total is\n#### 42", "42"),  # GSM8K-style fallback
    ("Answer: 1234", "Natalia sold 48 clips ... #### 1,234"),  # GSM8K ground truth
    ("Answer: 72", "#### 72"),
    ("Answer: 13", "$13$"),
    ("Answer: 13", "\\boxed{13}"),
    ("Answer: 13", 13),  # integer ground truth from a parquet column
    ("Answer: \\$5", "5"),
    ("Answer: 3 hours", "3"),
]


@pytest.mark.parametrize(("response", "truth"), POSITIVE)
def test_correct_answers_score_plus_one(response: str, truth: str) -> None:
    result = compute_score(response, truth)
    assert result == RewardResult(score=1.0, acc=True, pred=result.pred)
    assert result.pred


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
def test_wrong_or_missing_answers_score_minus_one(response: str, truth: str, pred: str | None) -> None:
    assert compute_score(response, truth) == RewardResult(score=-1.0, acc=False, pred=pred)


@pytest.mark.parametrize(
    ("response", "pred"),
    [
        ("Answer: 1\n\\boxed{2}\n#### 3", "1"),  # Answer: beats \boxed beats ####
        ("\\boxed{2}\n#### 3", "2"),
        ("#### 3", "3"),
        ("Answer: $$\n\\boxed{2}", "2"),  # empty Answer: line falls through
    ],
)
def test_extraction_precedence(response: str, pred: str) -> None:
    assert math_dapo.extract_answer(response) == pred


def test_result_is_frozen() -> None:
    result = compute_score("Answer: 1", "1")
    with pytest.raises(AttributeError):
        result.score = 0.0  # type: ignore[misc]


def test_marker_must_be_in_tail() -> None:
    far = "Answer: 13\n" + "x" * (math_dapo.SEARCH_TAIL_CHARS + 10)
    assert compute_score(far, "13").pred is None


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
]


@pytest.mark.parametrize("response", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_adversarial_inputs_finish_quickly(response: str) -> None:
    start = time.perf_counter()
    result = compute_score(response, response)
    elapsed = time.perf_counter() - start
    assert result.score in (1.0, -1.0)
    assert elapsed < 2.0, f"took {elapsed:.2f}s"  # hang guard, not a benchmark


def test_trailing_answer_after_junk_is_found() -> None:
    assert compute_score("a" * 5_000_000 + "\nAnswer: 5", "5").acc


FRAGMENTS = st.sampled_from(
    ["Answer:", "answer :", "\\boxed{", "\\fbox{", "{", "}", "$", "####", "\n", " ", "=", ",",
     "\\text{", "\\frac", "sqrt", "-", "+", ".", "0", "7", "13", "1,000", "dollars", "\ud800", "*"]
)
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
@given(response=JUNK, truth=JUNK)
def test_fuzz_never_raises(response: str, truth: str) -> None:
    _check(compute_score(response, truth))


@settings(max_examples=100, deadline=None)
@given(junk=JUNK, n=st.integers(min_value=-(10**60), max_value=10**60))
def test_fuzz_integer_answer_is_recognised(junk: str, n: int) -> None:
    result = compute_score(f"{junk}\nAnswer: {n}", str(n))
    assert result.acc and result.score == 1.0
    assert compute_score(f"Answer: {n}", str(n + 1)).score == -1.0


@settings(max_examples=100, deadline=None)
@given(n=st.integers(min_value=0, max_value=10**12))
def test_fuzz_thousands_separators(n: int) -> None:
    assert compute_score(f"Answer: {n:,}", str(n)).acc
    assert compute_score(f"Answer: {n}", f"#### {n:,}").acc


def test_reward_package_imports_no_heavy_deps() -> None:
    allowed = {"__future__", "dataclasses", "logging", "re", "math", "operator", "sys",
               "collections", "typing", "megatron_dapo"}
    for path in pathlib.Path(math_dapo.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
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
