"""reward.name=math_verify: DAPO's answer line, also judged correct when Hugging Face's math-verify finds it
mathematically equivalent to the ground truth (an optional extra: `pip install "megatron-dapo[math]"`).

The answer is read exactly as math_dapo reads it (the last ``Answer:`` line; with answer_fallback=boxed also
the last ``\\boxed{}`` and ``####``), so the prompts need not change. It is correct when math_dapo's rule says
so (equal integers or equal normalised strings), or else when math-verify parses the candidate and the
ground truth (LaTeX or plain expressions, each wrapped in ``$...$`` unless it has a ``$`` already) and
verifies them equal with sympy: ``\\frac{1}{2}`` = ``0.5``, ``\\sqrt{8}`` = ``2\\sqrt{2}``, ``(1, 2]`` =
``(1,2]`` but not ``(1,2)``, ``\\{1,2\\}`` = ``\\{2,1\\}``. So it never scores fewer correct answers than
math_dapo; `pred` is math_dapo's normalised string (maj@k votes on it).

math-verify's own timeouts use SIGALRM, which would cancel the timer reward.timeout_s runs on (the Verifier
in verifiers.py: the same timeout, failure counting and RewardResult as a user's function), so they are off
here and reward.timeout_s bounds the whole call. A timeout interrupts Python code only: a single
arbitrary-precision operation in C finishes first.
"""

from __future__ import annotations

import logging
from typing import Any

from megatron_dapo.reward.math_dapo import (
    MAX_TRUTH_CHARS,
    AnswerFallback,
    RewardResult,
    compute_score,
    extract_answer_text,
    truth_text,
)

INSTALL_HINT = 'pip install "megatron-dapo[math]" (or pip install math-verify)'


class _OwnTimeout(logging.Filter):
    """Drops math-verify's one-time warning that its timeout is off: reward.timeout_s is the timeout."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


def load_math_verify() -> Any:
    """The math_verify module; ImportError (with the install line) when the extra is missing."""
    try:
        import math_verify
    except ImportError as e:
        raise ImportError(f"reward.name=math_verify needs the math-verify package: {INSTALL_HINT}") from e
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_OwnTimeout())
    return math_verify


def _as_math(text: str) -> str:
    return text if "$" in text else f"${text}$"


def math_verify_score(response: str, ground_truth: str, sample: Any = None, *,
                      answer_fallback: AnswerFallback = "none") -> RewardResult:
    """+1 if the answer line matches by math_dapo's rule or by math-verify's equivalence, else -1.

    May raise or run long on adversarial input: call it through reward.verifiers.Verifier (timeout, failures).
    """
    rule = compute_score(response, ground_truth, answer_fallback=answer_fallback)
    found = extract_answer_text(response, answer_fallback) if isinstance(response, str) else None
    truth = truth_text(ground_truth)
    if rule.acc or found is None or not truth or len(truth) > MAX_TRUTH_CHARS:
        return rule
    mv = load_math_verify()
    gold = mv.parse(_as_math(truth), parsing_timeout=None)
    answer = mv.parse(_as_math(found[0]), parsing_timeout=None)
    ok = bool(gold) and bool(answer) and bool(mv.verify(gold, answer, timeout_seconds=None))
    return RewardResult(score=1.0 if ok else -1.0, acc=ok, pred=rule.pred)
