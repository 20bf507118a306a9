"""Which policy version made which tokens (`Sample.versions`), and what that makes stale.

Version v means the weights after v updates. Off-policy pipelining and partial rollout train on tokens
older than the actor; a sample's oldest token decides its staleness.
"""

from __future__ import annotations

from megatron_dapo.types import Group, Sample


def stamp(samples: list[Sample], version: int, before: tuple[Sample, ...] = ()) -> None:
    """Record that `version` made each sample's tokens after those of `before[k]` (the sample as it was
    carried in: its spans are kept); a finished sample with no span gets (0, version), an unfinished one
    without tokens none (no policy made any of it yet)."""
    for k, s in enumerate(samples):
        prior = before[k] if k < len(before) else None
        spans = list(prior.versions) if prior is not None else []
        start = prior.response_len if prior is not None else 0
        if s.response_len > start or (not spans and s.finish_reason != "abort"):
            spans.append((start, version))
        s.versions = spans


def oldest_version(sample: Sample) -> int:
    """The policy version of the sample's oldest token."""
    return min(v for _, v in sample.versions)


def drop_stale(groups: list[Group], actor_version: int, max_staleness: int) -> tuple[list[Group], int]:
    """The groups whose every sample is at most `max_staleness` versions behind the actor's
    (`actor_version`: the updates the actor has made), and how many were dropped."""
    kept = [g for g in groups if all(actor_version - oldest_version(s) <= max_staleness for s in g.samples)]
    return kept, len(groups) - len(kept)


def staleness_scalars(groups: list[Group], actor_version: int, dropped: int) -> dict[str, float]:
    """rollout/staleness_mean / _max over the trained samples (updates between the oldest token's policy
    and the actor's), and rollout/dropped_stale_groups."""
    ages = [actor_version - oldest_version(s) for g in groups for s in g.samples]
    return {"rollout/staleness_mean": sum(ages) / len(ages) if ages else 0.0,
            "rollout/staleness_max": float(max(ages, default=0)),
            "rollout/dropped_stale_groups": float(dropped)}
