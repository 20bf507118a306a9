"""User reward functions (`reward.name=module.path:function`) and math_verify: loaded once, each call under
a timeout.

The function is called as `fn(response, ground_truth, sample)` (`sample`: the `types.Sample`, with its
token ids and finish reason) and returns a `RewardResult(score, acc, pred)`. A call that raises, runs
past the timeout or returns anything else is a failure: `Verifier` scores it like a wrong answer
(-1, acc False), counts it, and logs the first one with its traceback.
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

from megatron_dapo.config.fields import import_named
from megatron_dapo.config.schema import REWARD_FUNCTION
from megatron_dapo.reward.math_dapo import AnswerFallback, RewardResult, compute_score
from megatron_dapo.reward.math_verify_reward import load_math_verify, math_verify_score

log = logging.getLogger(__name__)

BUILTIN = "math_dapo"
MATH_VERIFY = "math_verify"
FAILED = RewardResult(score=-1.0, acc=False, pred=None)

RewardFn = Callable[[str, str, Any], RewardResult]


class RewardLoadError(ValueError):
    """reward.name names no importable callable; the message says what is wrong."""


class RewardTimeout(Exception):
    pass


def load_reward_fn(name: str, *, answer_fallback: AnswerFallback = "none") -> RewardFn:
    """The callable `name` stands for; math_dapo is DAPO eq. 7 with the configured answer fallback,
    math_verify the same answer line judged also by math-verify (math_verify_reward.py)."""
    if name == BUILTIN:
        return functools.partial(_math_dapo, answer_fallback=answer_fallback)
    if name == MATH_VERIFY:
        try:
            load_math_verify()
        except ImportError as e:
            raise RewardLoadError(str(e)) from None
        return functools.partial(math_verify_score, answer_fallback=answer_fallback)
    if not REWARD_FUNCTION.fullmatch(name):
        raise RewardLoadError(f"reward.name={name!r}: expected {BUILTIN!r}, {MATH_VERIFY!r} or "
                              "'module.path:function'")
    module_name, fn_name = name.split(":")
    fn = import_named(name, "reward.name", RewardLoadError)
    if not callable(fn):
        raise RewardLoadError(f"reward.name={name!r}: {module_name} has no callable {fn_name!r}")
    return fn


def _math_dapo(response: str, ground_truth: str, sample: Any, *,
               answer_fallback: AnswerFallback) -> RewardResult:
    return compute_score(response, ground_truth, answer_fallback=answer_fallback)


def call_with_timeout(fn: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
    """fn(*args), raising RewardTimeout after `timeout_s` (<= 0: no limit).

    In the main thread SIGALRM interrupts the call; elsewhere the call runs in a daemon thread that is
    abandoned when it overruns (Python cannot stop a thread).
    """
    if timeout_s <= 0:
        return fn(*args)
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        def alarm(signum, frame):
            raise RewardTimeout(f"no result after {timeout_s:g} s")

        previous = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            return fn(*args)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # handed to the caller's thread
            out["error"] = e

    worker = threading.Thread(target=target, daemon=True, name="reward-call")
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise RewardTimeout(f"no result after {timeout_s:g} s")
    if "error" in out:
        raise out["error"]
    return out["value"]


class Verifier:
    """`reward.name`'s function, loaded once; failures score -1 and are counted (`take_failures`)."""

    def __init__(self, name: str, *, timeout_s: float, answer_fallback: AnswerFallback = "none") -> None:
        self.name = name
        self.fn = load_reward_fn(name, answer_fallback=answer_fallback)
        # math_dapo is bounded by construction (see math_dapo.py) and never raises: no timer needed.
        self.timeout_s = 0.0 if name == BUILTIN else timeout_s
        self.failures = 0
        self.total_failures = 0

    def __call__(self, response: str, ground_truth: str, sample: Any = None) -> RewardResult:
        try:
            result = call_with_timeout(self.fn, (response, ground_truth, sample), self.timeout_s)
            if not isinstance(result, RewardResult):
                raise TypeError(f"returned {type(result).__name__} {result!r:.80}, expected a RewardResult")
        except Exception as e:
            self._failed(e)
            return FAILED
        return result

    def _failed(self, error: Exception) -> None:
        self.failures += 1
        self.total_failures += 1
        if self.total_failures == 1:
            log.warning("reward %s failed (%s: %s); such samples score -1, are counted in reward/failures, "
                        "and only this first failure is shown", self.name, type(error).__name__, error,
                        exc_info=error)

    def take_failures(self) -> int:
        """Failures since the last call (for the step's `reward/failures` monitor)."""
        n, self.failures = self.failures, 0
        return n
