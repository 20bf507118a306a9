"""Dynamic sampling: informative-group filter (by accuracy, paper eq. 11, or by score), multi-round
accumulation, exhaustion policies, eff(p)."""

import logging
import random

import pytest

from megatron_dapo.algo.dynamic_sampling import (
    DynamicSampler,
    expected_informative_fraction,
    is_informative,
)
from megatron_dapo.types import Group, Prompt, Sample


def make_group(uid: str, rewards: list[float], acc: list[bool] | None = None) -> Group:
    """A group with these rewards; a sample is correct when its reward is > 0 unless `acc` says."""
    acc = [r > 0 for r in rewards] if acc is None else acc
    samples = [
        Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[-0.1], finish_reason="stop", reward=r,
               acc=a)
        for r, a in zip(rewards, acc, strict=True)
    ]
    return Group(prompt=Prompt(uid=uid, messages=(), ground_truth="0"), samples=samples)


def shaped(uid: str, answers: list[tuple[bool, float]]) -> Group:
    """Eq. 7 reward (+1 right, -1 wrong) plus a soft overlong penalty (<= 0) per (correct, penalty)."""
    return make_group(uid, [(1.0 if ok else -1.0) + pen for ok, pen in answers], [ok for ok, _ in answers])


def good(uid: str) -> Group:
    return make_group(uid, [1.0, -1.0, -1.0, -1.0])


def bad(uid: str) -> Group:
    return make_group(uid, [1.0, 1.0, 1.0, 1.0])


@pytest.mark.parametrize("metric", ["acc", "score"])
def test_is_informative_plain_rewards(metric):
    assert is_informative(good("a"), metric)
    assert not is_informative(bad("a"), metric)
    assert not is_informative(make_group("a", [-1.0] * 4), metric)


def test_all_wrong_group_differing_only_by_overlong_penalty():
    # all wrong; soft overlong shaping (eq. 13) makes the rewards differ: -1, -1, -1.25, -2
    group = shaped("a", [(False, 0.0), (False, 0.0), (False, -0.25), (False, -1.0)])
    assert group.rewards == [-1.0, -1.0, -1.25, -2.0]
    assert not is_informative(group)  # acc is the default: the paper's 0 < #correct < G
    assert not is_informative(group, "acc")
    assert is_informative(group, "score")
    # all right, one penalised: the same split
    group = shaped("b", [(True, 0.0), (True, -0.5)])
    assert not is_informative(group, "acc") and is_informative(group, "score")


def test_acc_reads_correctness_not_rewards():
    # factor-2 penalty: a correct answer scores 1 - 2 = -1, the same as a wrong one
    group = shaped("a", [(True, -2.0), (False, 0.0)])
    assert group.rewards == [-1.0, -1.0]
    assert is_informative(group, "acc") and not is_informative(group, "score")


def test_unknown_metric():
    with pytest.raises(ValueError, match="acc, score"):
        is_informative(good("a"), "reward")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="metric"):
        DynamicSampler(target_groups=1, max_rounds=1, metric="reward")  # type: ignore[arg-type]


def mixed_round() -> list[Group]:
    """10 groups: 3 with right and wrong answers, 4 all wrong with different penalties, 2 all wrong
    without penalty, 1 all right."""
    mixed = [shaped(f"m{i}", [(True, 0.0), (False, -0.1 * i)]) for i in range(3)]
    penalised = [shaped(f"p{i}", [(False, 0.0), (False, -0.5)]) for i in range(4)]
    flat = [shaped(f"w{i}", [(False, 0.0), (False, 0.0)]) for i in range(2)]
    return mixed + penalised + flat + [shaped("r", [(True, 0.0), (True, 0.0)])]


@pytest.mark.parametrize(
    "metric, kept, frac, next_size",
    [
        # acc: 3/10 kept; 7 missing / 0.3 = 23.3 -> 24 groups next (cap 4 * 10)
        ("acc", ["m0", "m1", "m2"], 0.3, 24),
        # score: 7/10 kept; 3 missing / 0.7 = 4.29 -> 5
        ("score", ["m0", "m1", "m2", "p0", "p1", "p2", "p3"], 0.7, 5),
    ],
)
def test_kept_fraction_and_next_round_follow_the_metric(metric, kept, frac, next_size):
    sampler = DynamicSampler(target_groups=10, max_rounds=2, metric=metric)
    sampler.add_round(mixed_round())
    assert sampler.kept_frac == pytest.approx(frac)
    assert sampler.next_round_size(default=10) == next_size
    sampler.add_round([])
    groups, stats = sampler.finish()
    assert [g.prompt.uid for g in groups] == kept
    assert (stats.groups_seen, stats.groups_kept, stats.exhausted) == (10, len(kept), True)
    assert stats.kept_frac == frac


@pytest.mark.parametrize("metric, frac", [("acc", 0.3), ("score", 0.7)])
def test_disabled_sampler_reports_the_metrics_kept_fraction(metric, frac):
    sampler = DynamicSampler(target_groups=4, max_rounds=3, enabled=False, metric=metric)
    sampler.add_round(mixed_round())
    groups, stats = sampler.finish()
    assert [g.prompt.uid for g in groups] == ["m0", "m1", "m2", "p0"]
    assert stats.kept_frac == pytest.approx(frac) and not stats.exhausted


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


def test_a_stream_offering_groups_one_by_one_keeps_what_rounds_keep(caplog):
    """offer() is add_round()'s per-group decision: the same groups kept, the same stats and verdict; a stream
    names its own budget in the exhaustion line."""
    groups = [good("a"), bad("b"), good("c"), bad("d"), bad("e")]
    by_round = DynamicSampler(target_groups=3, max_rounds=1)
    by_round.add_round(groups)
    streamed = DynamicSampler(target_groups=3, max_rounds=1)
    assert [streamed.offer(g) for g in groups] == [True, False, True, False, False]
    assert streamed.kept == by_round.kept and streamed.seen == 5
    with caplog.at_level(logging.WARNING):
        kept, stats = streamed.finish(budget="5/5 streamed groups", seen_as="finished", rounds=1)
    assert kept == by_round.finish()[0] and stats == by_round.finish()[1] and stats.exhausted
    assert "kept 2/3 informative groups after 5/5 streamed groups (5 finished, kept fraction 0.400)" in caplog.text
    caplog.clear()
    DynamicSampler(target_groups=3, max_rounds=1, on_exhausted="error").finish(verdict=False)  # a failed step
    assert not caplog.text
