"""Rewards the user controls: `reward.name=module:function` loaded once, each call
under a timeout, failures scored -1 and counted with the first one shown; the math_dapo default kept
(strict Answer: rule + answer_fallback); the alarm for a step without a correct answer."""

import logging
import threading
import time
from typing import Any

import pytest

from megatron_dapo.config import LoggingConfig, RewardConfig, load_config, ConfigError
from megatron_dapo.metrics import Alarms
from megatron_dapo.reward import RewardLoadError, RewardResult, Scorer, Verifier, load_reward_fn
from megatron_dapo.reward.verifiers import RewardTimeout, call_with_timeout
from megatron_dapo.types import Sample

MODULE = '''
from megatron_dapo.reward import RewardResult
CALLS = []

def exact(response, ground_truth, sample):
    CALLS.append(response)
    ok = response.strip() == ground_truth
    return RewardResult(score=1.0 if ok else -1.0, acc=ok, pred=response.strip())

def slow(response, ground_truth, sample):
    import time
    time.sleep(5)
    return RewardResult(1.0, True, "x")

def boom(response, ground_truth, sample):
    raise ZeroDivisionError("boom " + response)

def wrong_type(response, ground_truth, sample):
    return 1.0

NOT_CALLABLE = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib
    import sys

    sys.modules.pop("my_rewards", None)
    importlib.invalidate_caches()
    return "my_rewards"


def sample(text, length=3, reason="stop"):
    return Sample(prompt_ids=[1], response_ids=[5] * length, rollout_logprobs=[0.0] * length, finish_reason=reason,
                  response_text=text)


def test_math_dapo_stays_the_strict_default():
    v = Verifier("math_dapo", timeout_s=1.0)
    assert v("Answer: 13", "13") == RewardResult(1.0, True, "13")
    assert v("\\boxed{13}", "13").score == -1.0  # only the Answer: line counts by default
    assert Verifier("math_dapo", timeout_s=1.0, answer_fallback="boxed")("\\boxed{13}", "13").acc


def test_user_function_is_loaded_once_and_called_with_the_sample(user_module):
    import my_rewards

    v = Verifier(f"{user_module}:exact", timeout_s=2.0)
    assert v(" 42 ", "42", sample(" 42 ")) == RewardResult(1.0, True, "42")
    assert v("41", "42", sample("41")).score == -1.0
    assert my_rewards.CALLS == [" 42 ", "41"] and v.take_failures() == 0


@pytest.mark.parametrize("name, fragment", [
    ("no_colon", "module.path:function"),
    ("not_a_module_xyz:fn", "cannot import"),
    ("my_rewards:missing", "no callable 'missing'"),
    ("my_rewards:NOT_CALLABLE", "no callable"),
])
def test_load_errors_name_the_problem(user_module, name, fragment):
    with pytest.raises(RewardLoadError, match=fragment):
        load_reward_fn(name)


def test_failures_score_minus_one_are_counted_and_the_first_is_shown(user_module, caplog):
    v = Verifier(f"{user_module}:boom", timeout_s=2.0)
    with caplog.at_level(logging.WARNING):
        results = [v(f"r{i}", "1", sample(f"r{i}")) for i in range(3)]
    assert results == [RewardResult(-1.0, False, None)] * 3
    assert v.take_failures() == 3 and v.take_failures() == 0
    shown = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(shown) == 1 and "boom r0" in shown[0].getMessage() and shown[0].exc_info
    wrong = Verifier(f"{user_module}:wrong_type", timeout_s=2.0)
    assert wrong("x", "1").score == -1.0 and wrong.take_failures() == 1


def test_a_slow_function_times_out(user_module):
    v = Verifier(f"{user_module}:slow", timeout_s=0.2)
    t0 = time.perf_counter()
    assert v("x", "1", sample("x")).score == -1.0
    assert time.perf_counter() - t0 < 2.0 and v.take_failures() == 1
    box: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: box.update(r=v("x", "1", sample("x"))))  # no SIGALRM off main
    t0 = time.perf_counter()
    worker.start()
    worker.join(10)
    assert box["r"].score == -1.0 and time.perf_counter() - t0 < 2.0 and v.take_failures() == 1


def test_call_with_timeout_passes_results_and_errors():
    assert call_with_timeout(lambda a, b: a + b, (2, 3), 1.0) == 5
    assert call_with_timeout(lambda: 7, (), 0) == 7  # 0 = no limit
    with pytest.raises(RewardTimeout):
        call_with_timeout(time.sleep, (3,), 0.1)
    box: dict[str, Any] = {}  # off the main thread the call runs in a helper thread: its error reaches the caller
    missing: dict[str, int] = {}
    t = threading.Thread(target=lambda: box.update(e=_catch(lambda: call_with_timeout(lambda: missing["k"], (), 1.0))))
    t.start()
    t.join()
    assert isinstance(box["e"], KeyError)


def _catch(fn):
    try:
        fn()
    except Exception as e:  # handed back to the test thread
        return e
    return None


def test_scorer_adds_the_overlong_term(user_module):
    cfg = RewardConfig(name=f"{user_module}:exact", overlong_cache_len=4)
    scorer = Scorer(cfg, max_response_len=10)
    s = sample("7", length=8)
    s.response_text = "7"
    scorer.score(s, "7")
    assert s.acc and s.pred == "7" and s.reward == pytest.approx(1.0 + (6 - 8) / 4)  # eq. 13 inside the buffer


def test_reward_config_checks():
    assert load_config(None, ["reward.name=pkg.mod:fn"]).reward.name == "pkg.mod:fn"
    for bad in ["reward.name=math", "reward.name=pkg.mod:", "reward.timeout_s=-1"]:
        with pytest.raises(ConfigError, match="reward"):
            load_config(None, [bad])


def test_alarm_when_no_answer_is_correct():
    alarms = Alarms(LoggingConfig(), max_response_len=100)
    assert alarms.check({"train/acc_mean": 0.0})["alarm/no_correct_answers"] == 1.0
    assert alarms.check({"train/acc_mean": 1 / 64})["alarm/no_correct_answers"] == 0.0
    assert "alarm/no_correct_answers" not in alarms.check({"val/acc_avg_at_k": 0.0})
