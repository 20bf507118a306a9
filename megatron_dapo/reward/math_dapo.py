"""Rule-based DAPO-Math reward (DAPO eq. 7): +1 if the extracted answer equals the truth, else -1.

The answer is the rest of the line after the LAST ``Answer:`` marker in the response (case-insensitive;
markdown ``**Answer:**`` too), or the next non-empty line when the marker ends its line: what the
DAPO prompt asks for. Nothing else counts by default: "The answer is 13" or a bare ``\\boxed{13}``
gives ``pred=None`` and score -1. With ``answer_fallback="boxed"`` (for prompts that ask for a box or
GSM8K's ``####``), a missing or empty ``Answer:`` line falls through, in this order, to the last
``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces, then the last ``#### ...`` line.

The ground truth may be plain (``"13"``), LaTeX (``"$\\frac{1}{2}$"``, ``"\\boxed{13}"``) or GSM8K
(``"... #### 1,234"``: the text after the last ``####``). Both sides go through the same Minerva-style
normalisation (Lewkowycz et al. 2022), which also reads the answer from inside the wrappers real completions
put around it: ``$..$``, ``$$..$$``, ``\\(..\\)``, ``\\[..\\]``, ``\\boxed``/``\\fbox``, ``\\text``,
``\\textbf``, ``\\mathbf``, ``\\mathrm``, ``\\overline``, ``*``/``**`` emphasis, nested ones too, and a
final percent sign (``42\\%``, ``42%``). The wrapper rule, applied from the outside in:

- Whitespace and a final period at the ends are dropped, and the answer is split into remark, core,
  remark. A remark is prose: letters, whitespace, ``.,;:?()"*``, dashes, quotes, CJK punctuation, a hyphen
  or apostrophe inside a word. The core runs from the first to the last character that is not prose: a
  digit, ``$``, a backslash and what it escapes, a brace or bracket, an operator, ``!``, a ``-`` or ``'``
  not inside a word.
- A wrapper counts when it encloses the WHOLE core (or is ``*`` emphasis touching it) and no letter touches
  the core: ``the result is $753$ (final)``, ``\\boxed{753}, as shown``, ``**753** (final)`` are all 753.
- Otherwise the answer is read as written, so a wrapped fragment glued to more of the answer never spells
  a number it does not: ``\\( 4 \\)2``, ``$4$2``, ``4$2$``, ``$4$x``, ``-$4$``, ``$4$!`` match neither 4
  nor 42. A digit outside the wrapper is in the core (``$4$ 2``, ``$753$ (part 2)``: as written), and so is
  a second wrapped fragment: ``$3$ or $4$`` is ambiguous and matches nothing (``$4$ or $4$`` neither).
- Without a wrapper around the core, remarks are not dropped (``753 (final)``, ``42% of them``: as
  written): nothing then says where the math ends (``2 pi``). Units after a wrapped number are a remark
  (``$7$ apples``); after a plain one Minerva's list drops the common ones (``12 dollars``).

Minerva (verl's ``normalize_final_answer``) keeps what the first ``$..$`` encloses, whatever surrounds it
(``$4$2`` is 4, ``$3$ or $4$`` is 3), and drops the remarks around that wrapper only;
tests/test_reward_minerva.py compares the two case by case.

Integers compare by value ("007" == "7", "-0" == "0", "1,000" == "1000", "12.0" == "12"); anything else
by normalised string equality.

Work is bounded for any input: markers are searched only in the last ``SEARCH_TAIL_CHARS`` characters
of the response, a candidate answer is at most ``MAX_ANSWER_CHARS`` long, truths longer than
``MAX_TRUTH_CHARS`` never match, brace matching is one linear pass, peeling wrappers is linear (a peel
scans only the remark and emphasis it drops), and every regex is linear.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Literal, get_args

__all__ = [
    "ANSWER_FALLBACKS",
    "AnswerFallback",
    "RewardResult",
    "compute_score",
    "extract_answer",
    "extract_answer_text",
    "normalize_answer",
    "truth_text",
]

AnswerFallback = Literal["none", "boxed"]
ANSWER_FALLBACKS: tuple[str, ...] = get_args(AnswerFallback)

SEARCH_TAIL_CHARS = 4096  # markers (Answer:, \boxed, ####) must lie in this tail of the response
MAX_ANSWER_CHARS = 300  # an extracted candidate answer is cut to this many characters
MAX_TRUTH_CHARS = 10_000  # longer ground truths are treated as unmatchable (acc=False)

_log = logging.getLogger(__name__)

_ANSWER_MARKER = re.compile(r"answer[ \t*]*:\**", re.IGNORECASE)  # "**Answer:**" ends after the "**"
_BOX_COMMANDS = ("\\boxed", "\\fbox")
_WRAPPER_COMMANDS = ("\\text", "\\textbf", "\\mathbf", "\\mathrm", "\\overline")
_BRACE_WRAPPERS = tuple(f"{command}{{" for command in _BOX_COMMANDS + _WRAPPER_COMMANDS)
# (opening, closing, tokens the content may not hold): math delimiters do not nest.
_DELIMITERS = (("$$", "$$", ("$",)), ("$", "$", ("$",)), ("\\(", "\\)", ("\\(", "\\)")),
               ("\\[", "\\]", ("\\[", "\\]")))
# Characters a remark around a wrapped answer may hold besides letters and whitespace (see _is_prose); no
# digits, no "$", "\\", braces, brackets, operators, "!" (a factorial) or a minus sign.
_PROSE_PUNCTUATION = frozenset(
    ".,;:?()\"*\u2014\u2013\u2026\u201c\u201d\uff0c\u3002\uff1a\uff1b\uff1f\uff08\uff09"  # dashes, CJK
)
_IN_WORD = frozenset("-'\u2019")  # prose only between two letters: "well-known", "that's"
_EMPHASIS_AND_SPACE = "* \t\n\r\f\v"
_FRAC_SHORTHAND = re.compile(r"frac([^{])(.)")
_SQRT_SHORTHAND = re.compile(r"sqrt([^{])")
_THOUSANDS = re.compile(r"[+-]?[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?")
_INTEGER = re.compile(r"(-?)([0-9]+)(?:\.0*)?")

# Minerva normalize_final_answer tables (applied in this order, as plain substring operations).
SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
    ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
REMOVED_EXPRESSIONS: tuple[str, ...] = (
    "square", "ways", "integers", "dollars", "mph", "inches", "ft", "hours", "km", "units",
    "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm",
    "pounds", "meters", "meals", "edges", "students", "childrentickets", "multiples",
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots",
)


@dataclass(frozen=True)
class RewardResult:
    score: float  # +1.0 correct, -1.0 otherwise (DAPO eq. 7)
    acc: bool
    pred: str | None  # normalised extracted answer, None when nothing was extracted


def last_boxed(text: str) -> str | None:
    """Content of the last-opened ``\\boxed{..}``/``\\fbox{..}`` whose braces balance, else None.

    One left-to-right pass with a brace stack, so the cost is linear in ``len(text)``.
    """
    stack: list[int] = []  # content start index for boxed groups, -1 for plain braces
    best_start = -1
    best: str | None = None
    for i, ch in enumerate(text):
        if ch == "{":
            boxed = any(text.endswith(cmd, 0, i) for cmd in _BOX_COMMANDS)
            stack.append(i + 1 if boxed else -1)
        elif ch == "}" and stack:
            start = stack.pop()
            if start > best_start:
                best_start, best = start, text[start:i]
    return best


def _closing_braces(text: str) -> dict[int, int]:
    """Index of the matching ``}`` of every ``{`` that closes; one pass with a stack."""
    closing: dict[int, int] = {}
    stack: list[int] = []
    for i, ch in enumerate(text):
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            closing[stack.pop()] = i
    return closing


def _trimmed(text: str, lo: int, hi: int) -> tuple[int, int]:
    """``text[lo:hi]`` without whitespace at its ends, nor a final period."""
    while lo < hi and text[lo].isspace():
        lo += 1
    while hi > lo and (text[hi - 1].isspace() or text[hi - 1] == "."):
        hi -= 1
    return lo, hi


def _is_prose(text: str, i: int) -> bool:
    """Whether ``text[i]`` can belong to a remark around the answer: a letter, whitespace, prose punctuation,
    markdown emphasis, or a hyphen/apostrophe inside a word. Digits, ``$``, ``\\``, braces, operators, and
    what a backslash escapes (the ``)`` of ``\\)``) are not."""
    ch = text[i]
    if i > 0 and text[i - 1] == "\\":
        return False
    if ch.isalpha() or ch.isspace() or ch in _PROSE_PUNCTUATION:
        return True
    return ch in _IN_WORD and 0 < i < len(text) - 1 and text[i - 1].isalpha() and text[i + 1].isalpha()


def _core(text: str, lo: int, hi: int) -> tuple[int, int]:
    """``text[lo:hi]`` without the prose at its ends: from its first to its last non-prose character."""
    while lo < hi and _is_prose(text, lo):
        lo += 1
    while hi > lo and _is_prose(text, hi - 1):
        hi -= 1
    return lo, hi


def _emphasis(text: str, lo: int, hi: int, core_lo: int, core_hi: int) -> tuple[int, int]:
    """How many ``*`` touch the core ``text[core_lo:core_hi]`` on its left and on its right, in ``lo:hi``."""
    left = core_lo
    while left > lo and text[left - 1] == "*":
        left -= 1
    right = core_hi
    while right < hi and text[right] == "*":
        right += 1
    return core_lo - left, right - core_hi


def _glued(text: str, lo: int, hi: int, core_lo: int, core_hi: int) -> bool:
    """Whether a letter touches the core (past the ``*`` of emphasis): ``x$4$``, ``$4$x``, ``**4**x``."""
    left, right = _emphasis(text, lo, hi, core_lo, core_hi)
    before, after = core_lo - left - 1, core_hi + right
    return (before >= lo and text[before].isalpha()) or (after < hi and text[after].isalpha())


def _peeled(text: str, lo: int, hi: int, core_lo: int, core_hi: int,
            closing: dict[int, int]) -> tuple[int, int] | None:
    """The window the answer ``text[lo:hi]`` (remark, core ``text[core_lo:core_hi]``, remark) is read from
    once its outermost wrapper is dropped, or None. The wrapper counts when it encloses the whole core
    (``$..$``, ``\\boxed{..}``, ...) or is ``*`` emphasis touching it, and no letter is glued on; a final
    percent sign is dropped only when there is no remark (``42%``, not ``42% of them``)."""
    if _glued(text, lo, hi, core_lo, core_hi):
        return None
    inner = _inside(text, core_lo, core_hi, closing)
    if inner is not None:
        return inner
    if (core_lo, core_hi) == (lo, hi):  # a percent sign ends a number without marking off a remark
        return _without_percent(text, lo, hi)
    return (core_lo, core_hi) if any(_emphasis(text, lo, hi, core_lo, core_hi)) else None


def _inside(text: str, lo: int, hi: int, closing: dict[int, int]) -> tuple[int, int] | None:
    """The window inside the wrapper that encloses all of ``text[lo:hi]``, or None when there is none."""
    for opening, closing_delimiter, forbidden in _DELIMITERS:
        inner_lo, inner_hi = lo + len(opening), hi - len(closing_delimiter)
        if (inner_lo <= inner_hi and text.startswith(opening, lo) and text.endswith(closing_delimiter, lo, hi)
                and all(text.find(token, inner_lo, inner_hi) < 0 for token in forbidden)):
            return inner_lo, inner_hi
    for command in _BRACE_WRAPPERS:
        if text.startswith(command, lo) and closing.get(lo + len(command) - 1) == hi - 1:
            return lo + len(command), hi - 1
    return None


def _without_percent(text: str, lo: int, hi: int) -> tuple[int, int] | None:
    """``text[lo:hi]`` without its final percent sign (``42\\%``, ``42%``), or None when it has none."""
    for percent in ("\\%", "%"):
        if text.endswith(percent, lo, hi):
            return lo, hi - len(percent)
    return None


def _unwrapped(text: str) -> str:
    """``text`` read from inside its wrappers, peeled from the outside in (``$\\mathbf{42}\\%$.`` -> ``42``,
    ``Answer is $753$ (final)`` -> ``753``); a wrapper around part of the answer stays as written
    (``\\(4\\)2``).
    Linear in ``len(text)``: the braces are matched once, each peel scans only the prose it drops and the
    ``*`` next to it, and every other test is a bounded string search."""
    closing = _closing_braces(text)
    lo, hi = 0, len(text)
    while True:
        lo, hi = _trimmed(text, lo, hi)
        core_lo, core_hi = _core(text, lo, hi)
        if core_lo == core_hi:  # prose only ("(B)", "**Monday**"): without its emphasis, as before
            return text[lo:hi].strip(_EMPHASIS_AND_SPACE)
        inner = _peeled(text, lo, hi, core_lo, core_hi, closing)
        if inner is None:
            return text[lo:hi]
        lo, hi = inner


def normalize_answer(answer: str) -> str:
    """Minerva-style normalisation of a final answer (plus sign, period and separator cleanup).

    Wrappers are read by the rule of ``_unwrapped``: before the last ``=`` is taken, after it (``x = $5$
    (final)``), and after Minerva's substitutions (which drop spaces, units and escaped dollars)."""
    text = _unwrapped(_unwrapped(answer.replace("\\$", "")).rsplit("=", 1)[-1])
    for before, after in SUBSTITUTIONS:
        text = text.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        text = text.replace(expr, "")
    text = _unwrapped(text)
    text = _FRAC_SHORTHAND.sub(r"frac{\1}{\2}", text)
    text = _SQRT_SHORTHAND.sub(r"sqrt{\1}", text)
    if text.startswith("+"):
        text = text[1:]
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    return text


def _canonical_int(text: str) -> str | None:
    """Canonical decimal form of an integer-valued answer ("-007.00" -> "-7"), else None."""
    match = _INTEGER.fullmatch(text)
    if match is None:
        return None
    digits = match.group(2).lstrip("0") or "0"
    return digits if digits == "0" else match.group(1) + digits


def _answers_equal(pred: str, truth: str) -> bool:
    pred_int, truth_int = _canonical_int(pred), _canonical_int(truth)
    if pred_int is not None and truth_int is not None:
        return pred_int == truth_int
    return pred == truth


def _line_after(text: str, pos: int) -> str:
    """The rest of the line from ``pos`` (or the next non-empty line), capped in length; without the ``*``
    at its ends when they mark up the whole line (``**42**``, ``42**``), kept when they bold a part
    (``**7** (final)``)."""
    line = text[pos:pos + MAX_ANSWER_CHARS].lstrip().split("\n", 1)[0].strip()
    bare = line.strip(_EMPHASIS_AND_SPACE)
    return line if "*" in bare else bare


def _candidates(tail: str, answer_fallback: AnswerFallback) -> list[str]:
    """Raw answer candidates in precedence order: Answer: line, then ("boxed") \\boxed and ####."""
    found: list[str] = []
    marker = None
    for marker in _ANSWER_MARKER.finditer(tail):
        pass
    if marker is not None:
        found.append(_line_after(tail, marker.end()))
    if answer_fallback == "none":
        return found
    boxed = last_boxed(tail)
    if boxed is not None:
        found.append(boxed[-MAX_ANSWER_CHARS:])
    hashes = tail.rfind("####")
    if hashes >= 0:
        found.append(_line_after(tail, hashes + 4))
    return found


def extract_answer(response: str, answer_fallback: AnswerFallback = "none") -> str | None:
    """Normalised answer extracted from a model response, or None (see module docstring)."""
    found = extract_answer_text(response, answer_fallback)
    return None if found is None else found[1]


def extract_answer_text(response: str, answer_fallback: AnswerFallback = "none") -> tuple[str, str] | None:
    """(the raw candidate, its normalised form) that extract_answer reads, or None."""
    for candidate in _candidates(response[-SEARCH_TAIL_CHARS:], answer_fallback):
        pred = normalize_answer(candidate)
        if pred:
            return candidate, pred
    return None


def truth_text(ground_truth: object) -> str:
    """The ground truth as compared: a number as text, a GSM8K answer's part after "####" ("" if unusable)."""
    return _truth_text(_as_text(ground_truth))


def _truth_text(ground_truth: str) -> str:
    hashes = ground_truth.rfind("####")
    return ground_truth[hashes + 4:] if hashes >= 0 else ground_truth


def _as_text(value: object) -> str:
    """Strings pass through; numbers (a parquet column of ints) become text; anything else ""."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return ""


def _score(response: str, ground_truth: str, answer_fallback: AnswerFallback) -> RewardResult:
    pred = extract_answer(response, answer_fallback)
    truth = _truth_text(ground_truth)
    acc = (
        pred is not None
        and len(truth) <= MAX_TRUTH_CHARS
        and _answers_equal(pred, normalize_answer(truth))
    )
    return RewardResult(score=1.0 if acc else -1.0, acc=acc, pred=pred)


def compute_score(
    response: str, ground_truth: str, *, answer_fallback: AnswerFallback = "none"
) -> RewardResult:
    """DAPO eq. 7 reward of one response against its ground truth; never raises for any input.

    answer_fallback: "none" (DAPO: only the ``Answer:`` line counts) or "boxed" (then the last
    ``\\boxed{}``, then ``####``); an unknown value is a programming error (ValueError).

    The guard below is narrow and documented: the parser is written not to raise for any str input
    (fuzzed in tests); should a bug slip through, the sample scores -1 and a warning is logged
    instead of killing a rollout worker.
    """
    if answer_fallback not in ANSWER_FALLBACKS:
        raise ValueError(f"answer_fallback must be one of {ANSWER_FALLBACKS}, got {answer_fallback!r}")
    try:
        return _score(_as_text(response), _as_text(ground_truth), answer_fallback)
    except (ValueError, IndexError, RecursionError) as exc:  # pragma: no cover - defensive
        _log.warning("reward parser failed (%s: %s); scoring -1", type(exc).__name__, exc)
        return RewardResult(score=-1.0, acc=False, pred=None)
