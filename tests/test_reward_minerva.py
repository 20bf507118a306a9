"""Our wrapper rule against the Minerva normaliser DAPO's reward descends from, case by case.

The reference below is a transcription of verl's DAPO reward (volcengine/verl, verl/utils/reward_score/
math_dapo.py at b178a3cd: ``normalize_final_answer`` and ``is_correct_minerva``'s ``Answer:`` pattern, itself
adapted from lm-evaluation-harness' hendrycks_math utils). It is written out here, not imported from our
module, so that it stays an independent reference: only the steps that read a final answer are kept.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dapo.reward import compute_score

# verl's tables, verbatim (ours adds "ft" to the removals).
MINERVA_SUBSTITUTIONS = [
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
]
MINERVA_REMOVED = [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
    r",\!", "{,}", '"', "\\dots",
]


def minerva_normalize(final_answer: str) -> str:
    """verl's normalize_final_answer: the text after the last "=", tables applied, then what the FIRST $..$
    encloses (the text around it dropped), then \\text/\\textbf/\\overline/\\boxed contents, shorthand TeX."""
    final_answer = final_answer.split("=")[-1]
    for before, after in MINERVA_SUBSTITUTIONS:
        final_answer = final_answer.replace(before, after)
    for expr in MINERVA_REMOVED:
        final_answer = final_answer.replace(expr, "")
    final_answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", final_answer)
    final_answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", final_answer)
    final_answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", final_answer)
    final_answer = final_answer.replace("$", "")
    if final_answer.replace(",", "").isdigit():
        final_answer = final_answer.replace(",", "")
    return final_answer.strip()


def minerva_correct(response: str, truth: str) -> bool:
    """verl's is_correct_minerva on the last 300 characters, as its compute_score calls it."""
    match = re.findall(r"(?i)Answer\s*:\s*([^\n]+)", response[-300:])
    return minerva_normalize(match[-1] if match else "[INVALID]") == minerva_normalize(truth)


# (the Answer: line, truth, ours, Minerva's, why they differ: "" when they agree).
ONLY_DOLLARS = "Minerva drops the text around $..$ only"
GLUED = "Minerva keeps what the first $..$ encloses even when more of the answer is glued to it"
CASES = [
    # A wrapped answer with a remark before or after: the case and its kin.
    ("$753$ (final)", "753", True, True, ""),
    ("the result is $753$", "753", True, True, ""),
    ("$753$, which is the final answer.", "753", True, True, ""),
    ("$753$ apples", "753", True, True, ""),
    ("$753$ km", "753", True, True, ""),
    ("about $42$ or so", "42", True, True, ""),
    ("($753$)", "753", True, True, ""),
    ("$753$ (最终答案)", "753", True, True, ""),
    ("x = $5$ (final)", "5", True, True, ""),
    ("$\\boxed{753}$ (final)", "753", True, True, ""),
    ("**$753$** (final)", "753", True, True, ""),
    ("$\\frac{1}{2}$ inches", "\\frac{1}{2}", True, True, ""),
    ("\\(753\\) (final)", "753", True, False, ONLY_DOLLARS),
    ("\\[753\\] (final)", "753", True, False, ONLY_DOLLARS),
    ("x \\(42\\)", "42", True, False, ONLY_DOLLARS),
    ("\\(42\\) m", "42", True, False, ONLY_DOLLARS),
    ("\\boxed{753} (final)", "753", True, False, ONLY_DOLLARS + "; its \\boxed{ regex runs to the last }"),
    ("\\textbf{753} (final)", "753", True, False, ONLY_DOLLARS),
    ("**753** (final)", "753", True, False, ONLY_DOLLARS + "; ** is markdown bold, a wrapper to us"),
    ("$$753$$ (final)", "753", True, False, "Minerva's first $..$ is the empty one between the two $ of $$"),
    ("$42\\%$ (final)", "42", True, False, "Minerva keeps \\%"),
    # Nothing marks where the math ends: both read it as written.
    ("753 (final)", "753", False, False, ""),
    ("42% of them", "42", False, False, ""),
    # Wrapped fragments glued to more of the answer, or next to another number: never a number not spelled.
    ("$4$2", "42", False, False, ""),
    ("\\( 4 \\)2", "42", False, False, ""),
    ("\\( 4 \\)2", "4", False, False, ""),
    ("\\boxed{3} or \\boxed{4}", "3", False, False, ""),
    ("$4$2", "4", False, True, GLUED),
    ("4$2$", "2", False, True, GLUED),
    ("-$4$", "4", False, True, GLUED + " (the minus sign makes it -4)"),
    ("-$4$", "-4", False, False, ""),
    ("$4$!", "4", False, True, GLUED + " (4! is a factorial)"),
    ("$4$x", "4", False, True, GLUED + " (4x)"),
    ("$4$ 2", "4", False, True, GLUED + "; a digit outside the wrapper leaves it ambiguous to us"),
    ("$4$ $2$", "4", False, True, GLUED + "; two wrapped fragments are ambiguous to us"),
    ("$3$ or $4$", "3", False, True, "two wrapped fragments: ambiguous, a grader accepts neither"),
    ("$3$ or $4$", "4", False, False, ""),
    ("$753$ (part 2)", "753", False, True, "a digit in a remark is part of the answer to us"),
    ("$753$ \\quad (final)", "753", False, True, "a backslash command is not prose to us (conservative)"),
]


@pytest.mark.parametrize(("line", "truth", "ours", "minerva", "why"), CASES)
def test_against_minerva_case_by_case(line: str, truth: str, ours: bool, minerva: bool, why: str) -> None:
    response = f"Some reasoning.\nAnswer: {line}"
    assert compute_score(response, truth).acc is ours
    assert minerva_correct(response, truth) is minerva
    assert (ours != minerva) == bool(why), "every difference is explained, and only differences"


def test_the_reference_is_minervas_rule() -> None:
    """The transcription keeps the first $..$'s content and drops what surrounds it, as Minerva does."""
    assert minerva_normalize("$753$ (final)") == "753"
    assert minerva_normalize("$3$ or $4$") == "3"
    assert minerva_normalize("x = \\boxed{1,000}") == "1000"
    assert minerva_normalize("\\text{(B)}") == "(B)"


PROSE = st.text(alphabet="abcdefghijklmnopqrstuvwxyz ,;()", max_size=30)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(min_value=0, max_value=10**9), before=PROSE, after=PROSE)
def test_fuzz_dollar_wrapped_with_remarks_agrees_with_minerva(n: int, before: str, after: str) -> None:
    """Where Minerva drops remarks (around $..$), we agree: the number is read, whatever the words around."""
    response = f"Answer: {before} ${n}$ {after}"
    assert compute_score(response, str(n)).acc
    assert minerva_correct(response, str(n))
