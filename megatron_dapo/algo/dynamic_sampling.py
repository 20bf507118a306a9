"""Dynamic sampling (DAPO §3.2, eq. 11): keep only informative groups; generate until N are kept.

The paper keeps a group when 0 < #correct < G (metric "acc"). A group that is all right or all
wrong says nothing about correctness: with +-1 rewards its advantages are all zero, and with soft
overlong shaping an all-wrong group's advantages merely rank its wrong answers by length. Metric
"score" keeps any group whose rewards differ, such all-wrong groups included.

With per-response accuracy p the expected kept fraction (metric "acc") is
eff(p) = 1 - p^G - (1-p)^G, which collapses as the policy improves (G=16: p=0.95 -> 0.56,
p=0.99 -> 0.15); the sampler therefore sizes each new round from the fraction it has observed.

Typical use, one sampler per training step::

    sampler = DynamicSampler(target_groups=512, max_rounds=8)
    while not sampler.done:
        sampler.add_round(generate(sampler.next_round_size(default=512)))
    groups, stats = sampler.finish()
    if not groups:
        ...  # skip the step (train_partial with no informative group at all)

Both collectors use it (collect/rounds.py by rounds; collect/streaming.py group by group with
`offer` and `inflight`): what is kept, how much more to generate, and the verdict when the budget runs out
are decided here only.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import get_args

from megatron_dapo.config.schema import FilterMetric, OnExhausted
from megatron_dapo.types import Group

logger = logging.getLogger(__name__)

_ON_EXHAUSTED: tuple[str, ...] = get_args(OnExhausted)
FILTER_METRICS: tuple[str, ...] = get_args(FilterMetric)


def is_informative(group: Group, metric: FilterMetric = "acc") -> bool:
    """Whether dynamic sampling keeps `group`.

    "acc" (paper eq. 11): 0 < #correct < G, by each sample's `acc`.
    "score": the rewards are not all equal (non-zero std); with soft overlong shaping two wrong
    answers of different lengths differ, and such an all-wrong group is kept.
    """
    if metric == "acc":
        return 0 < group.num_correct < len(group.samples)
    if metric == "score":
        rewards = group.rewards
        return len(rewards) >= 2 and max(rewards) != min(rewards)
    raise ValueError(f"unknown filter metric {metric!r}; valid: {', '.join(FILTER_METRICS)}")


def expected_informative_fraction(p: float, G: int) -> float:
    """eff(p) = 1 - p^G - (1-p)^G: the chance that G Bernoulli(p) answers are neither all right nor all wrong."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p}")
    if G < 1:
        raise ValueError(f"G must be >= 1, got {G}")
    return 1.0 - p**G - (1.0 - p) ** G


@dataclass
class DynamicSamplingStats:
    """What one step's sampling did (for the generation-rounds and kept-fraction monitors)."""

    rounds: int
    """Generation rounds run."""
    groups_seen: int
    """Groups generated over all rounds."""
    groups_kept: int
    """Groups kept before trimming to the target (all groups when sampling is disabled)."""
    kept_frac: float
    """Fraction of seen groups that were informative (by the sampler's metric): the observed eff(p)
    for "acc". Reported even when disabled, where it is not groups_kept / groups_seen."""
    exhausted: bool
    """Filtering was on and fewer than target_groups informative groups were found."""


class DynamicSampler:
    """Accumulates generation rounds until `target_groups` informative groups are held.

    Args:
        target_groups: N, the number of groups a training step wants.
        max_rounds: cap on generation rounds; `done` turns true when it is reached.
        on_exhausted: what `finish()` does when short: "error" raises RuntimeError,
            "train_partial" logs a warning and returns the groups it has (possibly none).
        enabled: when False (the Table 1 ablation) one round is taken, nothing is filtered,
            and the round is trimmed to `target_groups`.
        kept_frac_floor: lower bound on the kept fraction used to size the next round, so an
            unlucky round with nothing kept does not ask for an unbounded batch.
        max_growth: the next round never exceeds `max_growth * default` groups.
        metric: what makes a group informative (see `is_informative`); the kept fraction, and so the
            size of the next round, follow it.
    """

    def __init__(
        self,
        target_groups: int,
        max_rounds: int,
        on_exhausted: OnExhausted = "train_partial",
        enabled: bool = True,
        *,
        kept_frac_floor: float = 0.1,
        max_growth: float = 4.0,
        metric: FilterMetric = "acc",
    ) -> None:
        if target_groups < 1:
            raise ValueError(f"target_groups must be >= 1, got {target_groups}")
        if max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")
        if on_exhausted not in _ON_EXHAUSTED:
            raise ValueError(f"on_exhausted must be one of {_ON_EXHAUSTED}, got {on_exhausted!r}")
        if not 0.0 < kept_frac_floor <= 1.0:
            raise ValueError(f"kept_frac_floor must be in (0, 1], got {kept_frac_floor}")
        if max_growth < 1.0:
            raise ValueError(f"max_growth must be >= 1, got {max_growth}")
        if metric not in FILTER_METRICS:
            raise ValueError(f"metric must be one of {FILTER_METRICS}, got {metric!r}")
        self.target_groups = target_groups
        self.max_rounds = max_rounds
        self.on_exhausted = on_exhausted
        self.enabled = enabled
        self.kept_frac_floor = kept_frac_floor
        self.max_growth = max_growth
        self.metric = metric
        self._kept: list[Group] = []
        self._rounds = 0
        self._seen = 0
        self._informative = 0

    @property
    def done(self) -> bool:
        """Enough groups are kept, the round cap is hit, or (disabled) one round has been taken."""
        if not self.enabled:
            return self._rounds >= 1
        return len(self._kept) >= self.target_groups or self._rounds >= self.max_rounds

    @property
    def kept_frac(self) -> float:
        """Observed informative fraction so far (0.0 before any group is seen)."""
        return self._informative / self._seen if self._seen else 0.0

    def add_round(self, groups: list[Group]) -> None:
        """Take one generation round; keeps the informative groups (all groups when disabled)."""
        if self.done:
            raise RuntimeError("add_round() called on a DynamicSampler that is already done")
        self._rounds += 1
        for group in groups:
            self.offer(group)

    def offer(self, group: Group) -> bool:
        """Take one finished group (a stream's, as it arrives); whether it was kept (informative, or any
        group when disabled)."""
        informative = is_informative(group, self.metric)
        self._seen += 1
        self._informative += informative
        if informative or not self.enabled:
            self._kept.append(group)
        return informative or not self.enabled

    @property
    def kept(self) -> list[Group]:
        """The groups kept so far, in arrival order (the live list)."""
        return self._kept

    @property
    def seen(self) -> int:
        return self._seen

    def inflight(self, first: int, oversample: float, max_inflight: int) -> int:
        """A stream's sizing: the groups that should be in flight now. `first` before any group finished,
        then `oversample` x the missing groups / the kept fraction (Laplace-smoothed, at least the floor), at
        most `max_inflight`."""
        if self._seen == 0:
            want = first
        else:
            frac = max((self._informative + 1) / (self._seen + 2), self.kept_frac_floor)
            want = math.ceil(oversample * (self.target_groups - len(self._kept)) / frac)
        return min(want, max_inflight)

    def next_round_size(self, default: int) -> int:
        """Number of groups to generate next: `default` first, then the expected count to fill the gap.

        After a round, asks for ceil(missing / max(kept_frac, floor)) groups, at most
        `max_growth * default` and at least 1. There is no head-room: a short round is simply
        followed by another, and overshoot is trimmed by `finish()`.
        """
        if default < 1:
            raise ValueError(f"default round size must be >= 1, got {default}")
        if self._rounds == 0 or not self.enabled:
            return default
        missing = max(self.target_groups - len(self._kept), 1)
        wanted = math.ceil(missing / max(self.kept_frac, self.kept_frac_floor))
        return max(1, min(wanted, math.floor(self.max_growth * default)))

    def finish(self, *, budget: str | None = None, seen_as: str = "groups seen", rounds: int | None = None,
               verdict: bool = True) -> tuple[list[Group], DynamicSamplingStats]:
        """Return the first `target_groups` kept groups (arrival order) and the step's stats.

        When filtering is on and fewer than `target_groups` were kept: "error" raises RuntimeError;
        "train_partial" warns and returns what there is, which may be an empty list, in which case
        the caller skips the optimizer step. A stream names its own `budget` spent ("7/7 streamed groups";
        default: the rounds), what its seen groups are (`seen_as`) and its `rounds`; `verdict=False` (a
        failed step) reports without warning or raising.
        """
        exhausted = self.enabled and len(self._kept) < self.target_groups
        stats = DynamicSamplingStats(
            rounds=self._rounds if rounds is None else rounds,
            groups_seen=self._seen,
            groups_kept=len(self._kept),
            kept_frac=self.kept_frac,
            exhausted=exhausted,
        )
        if exhausted and verdict:
            msg = (
                f"dynamic sampling kept {stats.groups_kept}/{self.target_groups} informative groups "
                f"after {budget or f'{stats.rounds}/{self.max_rounds} rounds'} ({stats.groups_seen} {seen_as}, "
                f"kept fraction {stats.kept_frac:.3f})"
            )
            if self.on_exhausted == "error":
                raise RuntimeError(msg)
            logger.warning("%s; training on the partial batch", msg)
        return self._kept[: self.target_groups], stats
