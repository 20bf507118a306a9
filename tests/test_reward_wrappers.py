"""The reward reads a wrapper (``\\( \\)``, ``$ $``, ``\\mathbf{}``, ``%``, ...) only around the WHOLE answer.

Around a part of the answer it is read as written, so the digits outside it are never glued on:
``Answer: \\( 4 \\)2`` is not 42. Wrappers around the whole answer are tested in test_reward.py (WRAPPED_42).
"""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_dapo.reward import compute_score, math_dapo
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
    ("x \\(42\\)", "42"), ("\\(42\\) m", "42"), ("about $42$ or so", "42"),  # text before / after
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
