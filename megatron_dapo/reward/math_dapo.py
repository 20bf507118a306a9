"""Rule-based DAPO-Math reward (DAPO eq. 7): +1 if the extracted answer equals the truth, else -1.

Extraction from the response, first hit wins (precedence):
  1. the LAST ``Answer:`` marker (case-insensitive; markdown ``**Answer:**`` too): the rest of its
     line, or the next non-empty line when the marker ends its line;
  2. the last ``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces;
  3. the last GSM8K-style ``#### ...`` line.
A candidate that normalises to "" falls through to the next rule. Nothing else counts: "The answer
is 13" without a marker gives ``pred=None`` and score -1.

The ground truth may be plain (``"13"``), LaTeX (``"$\\frac{1}{2}$"``, ``"\\boxed{13}"``) or GSM8K
(``"... #### 1,234"``: the text after the last ``####``). Both sides go through the same Minerva-style
normalisation (Lewkowycz et al. 2022). Integers compare by value ("007" == "7", "-0" == "0",
"1,000" == "1000", "12.0" == "12"); anything else by normalised string equality.

Work is bounded for any input: markers are searched only in the last ``SEARCH_TAIL_CHARS`` characters
of the response, a candidate answer is at most ``MAX_ANSWER_CHARS`` long, truths longer than
``MAX_TRUTH_CHARS`` never match, brace matching is one linear pass, and every regex is linear.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

__all__ = ["RewardResult", "compute_score", "normalize_answer", "extract_answer"]

SEARCH_TAIL_CHARS = 4096  # markers (Answer:, \boxed, ####) must lie in this tail of the response
MAX_ANSWER_CHARS = 300  # an extracted candidate answer is cut to this many characters
MAX_TRUTH_CHARS = 10_000  # longer ground truths are treated as unmatchable (acc=False)

_log = logging.getLogger(__name__)

_ANSWER_MARKER = re.compile(r"answer[ \t*]*:", re.IGNORECASE)
_BOX_COMMANDS = ("\\boxed", "\\fbox")
_WRAPPERS = re.compile(r"\\(?:text|textbf|overline)\{([^{}]*)\}")
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


def _first_math(text: str) -> str:
    """Content of the first ``$...$`` pair (Minerva), or the text unchanged."""
    first = text.find("$")
    second = text.find("$", first + 1) if first >= 0 else -1
    return text[first + 1:second] if second >= 0 else text


def normalize_answer(answer: str) -> str:
    """Minerva-style normalisation of a final answer (plus sign, period and separator cleanup)."""
    text = answer.strip()
    boxed = last_boxed(text)
    if boxed is not None:
        text = boxed
    text = text.rsplit("=", 1)[-1]
    for before, after in SUBSTITUTIONS:
        text = text.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        text = text.replace(expr, "")
    text = _first_math(text)
    text = _WRAPPERS.sub(r"\1", text)
    text = _FRAC_SHORTHAND.sub(r"frac{\1}{\2}", text)
    text = _SQRT_SHORTHAND.sub(r"sqrt{\1}", text)
    text = text.replace("$", "").strip().rstrip(".").strip()
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
    """The rest of the line from ``pos`` (or the next non-empty line), capped in length."""
    rest = text[pos:pos + MAX_ANSWER_CHARS].lstrip()
    return rest.split("\n", 1)[0].strip().strip("*").strip()


def _candidates(tail: str) -> list[str]:
    """Raw answer candidates in precedence order: Answer: line, \\boxed, ####."""
    found: list[str] = []
    marker = None
    for marker in _ANSWER_MARKER.finditer(tail):
        pass
    if marker is not None:
        found.append(_line_after(tail, marker.end()))
    boxed = last_boxed(tail)
    if boxed is not None:
        found.append(boxed[-MAX_ANSWER_CHARS:])
    hashes = tail.rfind("####")
    if hashes >= 0:
        found.append(_line_after(tail, hashes + 4))
    return found


def extract_answer(response: str) -> str | None:
    """Normalised answer extracted from a model response, or None (see module docstring)."""
    for candidate in _candidates(response[-SEARCH_TAIL_CHARS:]):
        pred = normalize_answer(candidate)
        if pred:
            return pred
    return None


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


def _score(response: str, ground_truth: str) -> RewardResult:
    pred = extract_answer(response)
    truth = _truth_text(ground_truth)
    acc = (
        pred is not None
        and len(truth) <= MAX_TRUTH_CHARS
        and _answers_equal(pred, normalize_answer(truth))
    )
    return RewardResult(score=1.0 if acc else -1.0, acc=acc, pred=pred)


def compute_score(response: str, ground_truth: str) -> RewardResult:
    """DAPO eq. 7 reward of one response against its ground truth; never raises.

    The guard below is narrow and documented: the parser is written not to raise for any str input
    (fuzzed in tests); should a bug slip through, the sample scores -1 and a warning is logged
    instead of killing a rollout worker.
    """
    try:
        return _score(_as_text(response), _as_text(ground_truth))
    except (ValueError, IndexError, RecursionError) as exc:  # pragma: no cover - defensive
        _log.warning("reward parser failed (%s: %s); scoring -1", type(exc).__name__, exc)
        return RewardResult(score=-1.0, acc=False, pred=None)
