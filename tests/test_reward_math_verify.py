"""reward.name=math_verify: a corpus of equivalent and non-equivalent answers (fractions, radicals, intervals,
sets, expressions) that the DAPO rule cannot decide, through the Verifier (the custom reward path: its
timeout, failure counting and RewardResult), plus the install hint when the extra is missing."""

import importlib.util
import sys
import time

import pytest

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.reward import RewardLoadError, RewardResult, Verifier, compute_score, load_reward_fn

needs_math_verify = pytest.mark.skipif(importlib.util.find_spec("math_verify") is None,
                                       reason="the math extra (pip install -e '.[math]') is not installed")

EQUIVALENT = [  # (response, ground truth): the same number, set or expression written differently
    ("Answer: $\\frac{1}{2}$", "0.5"),
    ("Answer: 0.5", "\\frac{1}{2}"),
    ("Answer: \\frac{2}{4}", "\\frac{1}{2}"),
    ("Answer: $\\dfrac{5}{6}$", "\\frac{10}{12}"),
    ("Answer: $2\\sqrt{2}$", "\\sqrt{8}"),
    ("Answer: 3\\sqrt{2}", "\\sqrt{18}"),
    ("Answer: $\\frac{\\sqrt{3}}{2}$", "\\frac{1}{2}\\sqrt{3}"),
    ("Answer: \\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}"),
    ("Answer: $\\sqrt{3}+2$", "2+\\sqrt{3}"),
    ("Answer: $\\pi/2$", "\\frac{\\pi}{2}"),
    ("Answer: $\\left(-\\infty, 3\\right)$", "(-\\infty,3)"),
    ("Answer: $x \\in (1, 2]$", "(1,2]"),
    ("Answer: [3, 4) \\cup (1, 2]", "(1,2]\\cup[3,4)"),
    ("Answer: $\\{2, 1\\}$", "\\{1,2\\}"),
    ("Answer: $(x+1)^2$", "x^2+2x+1"),
]
NOT_EQUIVALENT = [
    ("Answer: (1,2)", "(1,2]"),  # open vs half-open
    ("Answer: $(-\\infty, 3]$", "(-\\infty,3)"),
    ("Answer: $[0,1]$", "(0,1)"),
    ("Answer: $\\frac{2}{3}$", "\\frac{3}{2}"),
    ("Answer: 0.33", "\\frac{1}{3}"),
    ("Answer: $\\sqrt{2}$", "2\\sqrt{2}"),
    ("Answer: \\{1,2,3\\}", "\\{1,2\\}"),
    ("Answer: $x^2+1$", "x^2-1"),
    ("The answer is \\frac{1}{2}", "0.5"),  # no Answer: line: the DAPO rule reads nothing
]


@pytest.fixture(scope="module")
def verify():
    return Verifier("math_verify", timeout_s=10.0)


@needs_math_verify
@pytest.mark.parametrize("response, truth", EQUIVALENT)
def test_equivalent_answers_the_rule_cannot_decide(verify, response, truth):
    assert not compute_score(response, truth).acc, "a pair the DAPO rule already decides proves nothing"
    result = verify(response, truth)
    assert result == RewardResult(1.0, True, compute_score(response, truth).pred)
    assert verify.take_failures() == 0


@needs_math_verify
@pytest.mark.parametrize("response, truth", NOT_EQUIVALENT)
def test_different_answers_stay_wrong(verify, response, truth):
    assert verify(response, truth).score == -1.0 and not verify(response, truth).acc
    assert verify.take_failures() == 0


@needs_math_verify
def test_what_the_rule_accepts_math_verify_accepts(verify):
    for response, truth in [("Answer: 13", "13"), ("Answer: 1,000", "1000"), ("Answer: $-7$", "-7"),
                            ("Answer: 42", "... #### 42")]:
        assert compute_score(response, truth).acc and verify(response, truth).acc


@needs_math_verify
def test_the_answer_fallback_applies():
    boxed = Verifier("math_verify", timeout_s=10.0, answer_fallback="boxed")
    assert boxed("so \\boxed{\\frac{1}{2}}", "0.5").acc
    assert not Verifier("math_verify", timeout_s=10.0)("so \\boxed{\\frac{1}{2}}", "0.5").acc


@needs_math_verify
def test_timeouts_and_errors_are_counted_failures(monkeypatch, caplog):
    """The custom reward path's guarantees: a slow or raising check scores -1 and is counted."""
    import math_verify

    v = Verifier("math_verify", timeout_s=0.3)
    monkeypatch.setattr(math_verify, "verify", lambda *a, **k: time.sleep(5))
    t0 = time.perf_counter()
    assert v("Answer: \\frac{1}{2}", "0.5") == RewardResult(-1.0, False, None)
    assert time.perf_counter() - t0 < 3 and v.take_failures() == 1

    def boom(*a, **k):
        raise RuntimeError("sympy exploded")

    monkeypatch.setattr(math_verify, "verify", boom)
    assert v("Answer: \\frac{1}{2}", "0.5").score == -1.0 and v.take_failures() == 1
    assert v("Answer: 13", "13").acc  # the rule's answers never reach math-verify


def test_a_missing_extra_is_named_with_its_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify raises ImportError
    with pytest.raises(RewardLoadError, match=r"pip install \"megatron-dapo\[math\]\""):
        load_reward_fn("math_verify")


def test_config_accepts_math_verify():
    assert load_config(None, ["reward.name=math_verify"]).reward.name == "math_verify"
    with pytest.raises(ConfigError, match="must be one of math_dapo, math_verify or module.path:function"):
        load_config(None, ["reward.name=mathverify"])
