"""Dynamic sampling: informative-group filter, multi-round accumulation, exhaustion policies, eff(p)."""

import logging
import random

import pytest

from megatron_dapo.algo.dynamic_sampling import (
    DynamicSampler,
    expected_informative_fraction,
    is_informative,
)
from megatron_dapo.types import Group, Prompt, Sample


def make_group(uid: str, rewards: list[float]) -> Group:
    samples = [
        Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[-0.1], finish_reason="stop", reward=r, acc=r > 0)
        for r in rewards
    ]
    return Group(prompt=Prompt(uid=uid, messages=(), ground_truth="0"), samples=samples)


def good(uid: str) -> Group:
    return make_group(uid, [1.0, -1.0, -1.0, -1.0])


def bad(uid: str) -> Group:
    return make_group(uid, [1.0, 1.0, 1.0, 1.0])


def test_is_informative():
    assert is_informative(good("a"))
    assert not is_informative(bad("a"))
    assert not is_informative(make_group("a", [-1.0] * 4))
    # all wrong, but soft overlong shaping makes the rewards differ
    assert is_informative(make_group("a", [-1.0, -1.0, -1.25, -2.0]))


def test_expected_informative_fraction_paper_values():
    assert round(expected_informative_fraction(0.95, 16), 3) == 0.560
    assert round(expected_informative_fraction(0.99, 16), 3) == 0.149
    assert expected_informative_fraction(0.5, 2) == pytest.approx(0.5)
    assert expected_informative_fraction(1.0, 16) == 0.0


@pytest.mark.parametrize("p", [0.95, 0.99, 0.5])
def test_eff_matches_simulation(p):
    G, rng = 16, random.Random(1234)
    sampler = DynamicSampler(target_groups=1000, max_rounds=50)
    i = 0
    while not sampler.done:
        groups = []
        for _ in range(sampler.next_round_size(default=500)):
            groups.append(make_group(str(i), [1.0 if rng.random() < p else -1.0 for _ in range(G)]))
            i += 1
        sampler.add_round(groups)
    kept, stats = sampler.finish()
    assert len(kept) == 1000 and not stats.exhausted
    assert all(is_informative(g) for g in kept)
    assert stats.groups_seen == i
    assert stats.kept_frac == pytest.approx(expected_informative_fraction(p, G), abs=0.02)


def test_target_reached_over_rounds_and_trimmed_in_order():
    sampler = DynamicSampler(target_groups=5, max_rounds=4)
    assert sampler.next_round_size(default=4) == 4
    sampler.add_round([good("0"), bad("1"), good("2"), bad("3")])
    assert not sampler.done
    sampler.add_round([bad("4"), good("5"), bad("6"), good("7")])
    assert not sampler.done
    sampler.add_round([good("8"), good("9")])
    assert sampler.done
    with pytest.raises(RuntimeError):
        sampler.add_round([good("10")])
    kept, stats = sampler.finish()
    assert [g.prompt.uid for g in kept] == ["0", "2", "5", "7", "8"]
    assert (stats.rounds, stats.groups_seen, stats.groups_kept, stats.exhausted) == (3, 10, 6, False)
    assert stats.kept_frac == pytest.approx(0.6)


def test_cap_hit_with_error_raises():
    sampler = DynamicSampler(target_groups=3, max_rounds=2, on_exhausted="error")
    sampler.add_round([good("0"), bad("1")])
    sampler.add_round([bad("2"), bad("3")])
    assert sampler.done
    with pytest.raises(RuntimeError, match=r"kept 1/3 .* after 2/2 rounds"):
        sampler.finish()


def test_cap_hit_train_partial_warns_and_returns_partial(caplog):
    sampler = DynamicSampler(target_groups=3, max_rounds=2, on_exhausted="train_partial")
    sampler.add_round([good("0"), bad("1")])
    sampler.add_round([good("2"), bad("3")])
    with caplog.at_level(logging.WARNING, logger="megatron_dapo.algo.dynamic_sampling"):
        kept, stats = sampler.finish()
    assert [g.prompt.uid for g in kept] == ["0", "2"]
    assert stats.exhausted and stats.groups_kept == 2
    assert any("kept 2/3" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_train_partial_with_nothing_informative_returns_empty(caplog):
    sampler = DynamicSampler(target_groups=2, max_rounds=1)
    sampler.add_round([bad("0"), bad("1")])
    with caplog.at_level(logging.WARNING):
        kept, stats = sampler.finish()
    assert kept == [] and stats.exhausted and stats.kept_frac == 0.0


def test_disabled_keeps_everything_of_one_round_trimmed():
    sampler = DynamicSampler(target_groups=3, max_rounds=8, enabled=False)
    assert sampler.next_round_size(default=4) == 4
    sampler.add_round([bad("0"), good("1"), bad("2"), good("3")])
    assert sampler.done
    kept, stats = sampler.finish()
    assert [g.prompt.uid for g in kept] == ["0", "1", "2"]
    assert (stats.rounds, stats.groups_seen, stats.groups_kept, stats.exhausted) == (1, 4, 4, False)
    assert stats.kept_frac == pytest.approx(0.5)


def test_next_round_size_adapts():
    sampler = DynamicSampler(target_groups=100, max_rounds=10)
    assert sampler.next_round_size(default=100) == 100
    sampler.add_round([good(str(i)) for i in range(25)] + [bad(str(i)) for i in range(75)])
    # 75 missing at kept fraction 0.25 -> 300 (cap 4 * 100 = 400)
    assert sampler.next_round_size(default=100) == 300

    low = DynamicSampler(target_groups=100, max_rounds=10)
    low.add_round([bad(str(i)) for i in range(100)])
    # nothing kept: floor 0.1 -> 1000, capped at 4 * 100
    assert low.next_round_size(default=100) == 400

    high = DynamicSampler(target_groups=10, max_rounds=10)
    high.add_round([good(str(i)) for i in range(9)] + [bad("9")])
    assert high.next_round_size(default=10) == 2  # 1 missing / 0.9
    assert high.next_round_size(default=1) >= 1


def test_validation():
    with pytest.raises(ValueError):
        DynamicSampler(target_groups=0, max_rounds=1)
    with pytest.raises(ValueError):
        DynamicSampler(target_groups=1, max_rounds=0)
    with pytest.raises(ValueError):
        DynamicSampler(target_groups=1, max_rounds=1, on_exhausted="skip")  # type: ignore[arg-type]
