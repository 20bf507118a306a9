"""The reward reads a wrapper (``\\( \\)``, ``$ $``, ``\\mathbf{}``, ``**``, ...) around the whole answer, or
around all of it but a remark in words (``Answer: $753$ (final)``), as what it encloses.

Around a part of the answer it is read as written, so the digits outside it are never glued on:
``Answer: \\( 4 \\)2`` is not 42. Wrappers around the whole answer are tested in test_reward.py (WRAPPED_42),
the rule against Minerva's in test_reward_minerva.py.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_dapo.reward import RewardResult, compute_score, math_dapo
from megatron_dapo.reward.math_dapo import AnswerFallback
from support import MATH, WRAPS

# A wrapper counts only around the WHOLE answer: around a part it is read as written, so the digits outside
# it are never glued on. Each (answer, truth it must NOT match).
PARTLY_WRAPPED = [
    ("\\( 4 \\)2", "42"), ("\\(4\\)2", "42"), ("4\\(2\\)", "42"), ("\\[4\\]2", "42"), ("2\\[4\\]", "24"),
    ("$4$2", "42"), ("4$2$", "42"), ("$$4$$2", "42"), ("\\mathbf{4}2", "42"), ("4\\mathbf{2}", "42"),
    ("\\text{4}2", "42"), ("\\textbf{4}2", "42"), ("\\mathrm{4}2", "42"), ("4%2", "42"), ("4\\%2", "42"),
    ("\\boxed{4}2", "42"), ("\\boxed{4}2", "4"), ("3\\boxed{4}", "4"), ("\\fbox{4}2", "4"),
    ("$4$ $2$", "42"), ("$4$ $2$", "4"), ("$4$ $2$", "2"), ("\\(4\\) \\(2\\)", "42"), ("\\(4\\)\\(2\\)", "4"),
    ("\\boxed{4}\\boxed{2}", "2"), ("\\boxed{4}\\boxed{2}", "42"), ("\\mathbf{4}\\mathbf{2}", "42"),
    ("$4$ and $2$", "42"), ("\\text{4}\\%2", "42"), ("4%%2", "42"),
    ("\\(\\(4\\)2\\)", "42"), ("\\(4\\(2\\)", "42"), ("\\(4\\)2\\)", "42"), ("$$4$ $2$$", "42"),  # nested/unbalanced
    ("$4$$2$", "42"), ("\\text{\\mathbf{4}2}", "42"), ("\\text{4}}2", "42"), ("\\text{{4}2", "42"),
    ("$42", "42"), ("42$", "42"), ("\\(42", "42"), ("42\\)", "42"), ("\\mathbf{42", "42"),  # unbalanced
    ("$4$x", "4"), ("x$4$", "4"), ("**4**x", "4"), ("-$4$", "4"), ("-$4$", "-4"), ("$4$!", "4"),  # glued on
    ("$4$ 2", "4"), ("2 $4$", "4"), ("$4$ (2)", "4"), ("$753$ (part 2)", "753"),  # another number beside
    ("$3$ or $4$", "3"), ("$3$ or $4$", "4"), ("$4$ or $4$", "4"),  # several wrapped fragments
    ("\\boxed{3} or \\boxed{4}", "3"),
    ("**3** or **4**", "3"), ("753 (final)", "753"), ("42% of them", "42"),  # no wrapper marks off the remark
    ("\\(x = 4\\)2", "42"), ("$4.$2", "42"), ("\\mathbf{4}.2", "42"),
]


@pytest.mark.parametrize(("answer", "truth"), PARTLY_WRAPPED)
@pytest.mark.parametrize("fallback", ["none", "boxed"])
def test_a_wrapper_around_part_of_the_answer_is_read_as_written(answer: str, truth: str, fallback: AnswerFallback) -> None:
    for response in (f"Answer: {answer}", f"**Answer:** {answer}.", f"Answer:\n {answer} \n"):
        result = compute_score(response, truth, answer_fallback=fallback)
        assert result.score == -1.0 and not result.acc, (response, result)
    assert not compute_score(f"Answer: {truth}", answer).acc  # the same answer as a ground truth


@pytest.mark.parametrize(
    ("answer", "pred"),
    [("\\( 4 \\)2", "\\(4\\)2"), ("$4$ $2$", "$4$$2$"), ("\\mathbf{4}2", "\\mathbf{4}2"), ("4%2", "4%2"),
     ("$4$ dollars", "4"),  # a unit Minerva drops leaves the wrapper around the whole answer
     ("\\text{\\(42\\)}.", "42"), ("$\\text{42}\\%$.", "42"), ("**\\(42\\)**.", "42")],
)
def test_partly_wrapped_answers_normalise_as_written(answer: str, pred: str) -> None:
    assert math_dapo.normalize_answer(answer) == pred


@settings(max_examples=300, deadline=None)
@given(
    inside=st.integers(min_value=0, max_value=999),
    outside=st.integers(min_value=0, max_value=999),
    wraps=st.lists(st.sampled_from(WRAPS + MATH), min_size=1, max_size=4),
    before=st.booleans(),
    gap=st.sampled_from(["", " ", "  "]),
)
def test_fuzz_digits_outside_a_wrapper_are_never_glued_on(inside: int, outside: int, wraps: list, before: bool,
                                                           gap: str) -> None:
    assume(not (before and wraps[-1][0] == ""))  # "2 4%": a final percent sign encloses all the answer
    wrapped = str(inside)
    for opening, closing in wraps:
        wrapped = opening + wrapped + closing
    answer = f"{outside}{gap}{wrapped}" if before else f"{wrapped}{gap}{outside}"
    glued = f"{outside}{inside}" if before else f"{inside}{outside}"
    for truth in (glued, str(inside), str(outside)):
        assert not compute_score(f"Answer: {answer}", truth).acc, (answer, truth)


# ---- a remark around the wrapper: read as what the wrapper encloses -------------------------------------

# Every wrapper kind that encloses (a percent sign only ends a number), nested ones and \boxed inside $..$.
ENCLOSING = [wrap for wrap in WRAPS if wrap[0]] + MATH + [("\\overline{", "}")] + [
    ("$\\boxed{", "}$"), ("\\(\\boxed{", "}\\)"), ("\\[\\boxed{", "}\\]"), ("$$\\boxed{", "}$$"),
    ("**$", "$**"), ("\\boxed{$", "$}"), ("$\\text{", "}$"), ("\\textbf{\\(", "\\)}"),
    ("$\\mathbf{", "\\%}$"), ("**\\fbox{", "}**"),
]
REMARKS = ["{} (final)", "{}, which is the final answer.", "the result is {}", "so the total is {}.",
           "{} apples", "{} (the final answer)", "({})", "{} — done", "{} *(final)*", "thus {} km in all",
           "{}（最终答案）", "we get {}, as expected", "{}; that's well-known"]
# Each template puts more of the answer next to the wrapper: read as written, never 753 nor the glued number.
GLUED_ON = ["{}2", "2{}", "{}x", "x{}", "-{}", "{}!", "{} 2", "2 {}", "{}'", "{}.5", "2.{}", "{}^2", "{}/2",
            "{} or {}", "{} (or {})", "{} \\cdot 2"]


def _wrap(wrapper: tuple[str, str], answer: str) -> str:
    return wrapper[0] + answer + wrapper[1]


@pytest.mark.parametrize("wrapper", ENCLOSING, ids=[w[0] for w in ENCLOSING])
def test_a_wrapped_answer_with_a_remark_reads_as_what_the_wrapper_encloses(wrapper: tuple[str, str]) -> None:
    for template in REMARKS:
        line = template.format(_wrap(wrapper, "753"))
        for response in (f"Answer: {line}", f"**Answer:** {line}", f"Reasoning.\nAnswer:\n{line}\n"):
            for fallback in ("none", "boxed"):
                result = compute_score(response, "753", answer_fallback=fallback)
                assert result == RewardResult(1.0, True, "753"), response
            assert not compute_score(response, "754").acc
        assert math_dapo.normalize_answer(line) == "753", line  # a ground truth with a remark too


@pytest.mark.parametrize("wrapper", ENCLOSING, ids=[w[0] for w in ENCLOSING])
def test_a_wrapped_fragment_glued_to_more_of_the_answer_is_read_as_written(wrapper: tuple[str, str]) -> None:
    for template in GLUED_ON:
        line = template.format(_wrap(wrapper, "753"), _wrap(wrapper, "754"))
        for truth in ("753", "754", "7532", "2753", "-753", "753.5", "2.753"):
            for fallback in ("none", "boxed"):
                result = compute_score(f"Answer: {line}", truth, answer_fallback=fallback)
                assert not result.acc, (line, truth)
            assert not compute_score(f"Answer: {truth}", line).acc, (line, truth)


def test_the_percent_sign_drops_only_when_no_remark_follows() -> None:
    assert compute_score("Answer: 42% (final)", "42").pred == "42%(final)"  # as written, like "42 (final)"
    assert compute_score("Answer: $42\\%$ (final)", "42").acc  # inside a wrapper it is the whole core
    assert compute_score("Answer: **42%**, as shown", "42").acc


PROSE = st.text(alphabet="abcdefghijklmnopqrstuvwxyz ,.;?()", max_size=20)


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(min_value=-(10**9), max_value=10**9),
    outer=st.sampled_from(ENCLOSING),
    inner=st.lists(st.sampled_from(WRAPS), max_size=3),  # math mode is entered once: in `outer`
    before=PROSE,
    after=PROSE,
    opening=st.sampled_from(["", " ", " (", ", "]),
    closing=st.sampled_from(["", " ", ") ", ", ", ". "]),
)
def test_fuzz_remarks_around_a_wrapped_answer_are_dropped(n: int, outer, inner: list, before: str, after: str,
                                                           opening: str, closing: str) -> None:
    answer = str(n)
    for wrapper in inner + [outer]:
        answer = _wrap(wrapper, answer)
    before = f"{before} " if before.strip() else before  # a word never touches the wrapper: x$4$ is 4x
    after = f" {after}" if after.strip() else after
    line = f"{before}{opening}{answer}{closing}{after}"
    assert compute_score(f"Answer: {line}", str(n)).acc, line
    assert not compute_score(f"Answer: {line}", str(n + 1)).acc, line


@settings(max_examples=200, deadline=None)
@given(n=st.integers(min_value=0, max_value=10**9), outer=st.sampled_from(ENCLOSING),
       word=st.text(alphabet="xyz", min_size=1, max_size=5), before=st.booleans())
def test_fuzz_a_letter_touching_the_wrapper_is_part_of_the_answer(n: int, outer, word: str,
                                                                  before: bool) -> None:
    wrapped = _wrap(outer, str(n))
    line = f"{word}{wrapped}" if before else f"{wrapped}{word}"  # "x$4$" is 4x, not 4
    assert not compute_score(f"Answer: {line}", str(n)).acc, line


@pytest.mark.parametrize(
    ("truth", "pred"),
    [("* " * 2498 + "**7**" + " *" * 2498, "7"),  # emphasis among a remark of stars
     ("* " * 4999 + "x", "x"),  # prose only
     ("word " * 1999 + "$7$", "7"),
     ("\\boxed{a " * 999 + "7" + "}" * 999, "7"),  # a remark inside every one of 999 nested boxes
     ("$7$ " * 2500, "$7$$7$" * 1250)],  # 2500 wrapped fragments: as written
)
def test_remark_heavy_truths_of_maximal_length_are_quick(truth: str, pred: str) -> None:
    assert len(truth) <= math_dapo.MAX_TRUTH_CHARS
    start = time.perf_counter()
    assert math_dapo.normalize_answer(truth) == pred
    assert time.perf_counter() - start < 2.0  # hang guard: a peel rescanning its window takes ~15 s here
