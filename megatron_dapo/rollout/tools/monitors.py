"""A step's tool monitors over the samples it generated; none for single-turn samples (their runs unchanged)."""

from __future__ import annotations

from collections.abc import Sequence

from megatron_dapo.types import Sample

TOOL_TAGS = ("tool/calls_per_sample", "tool/error_frac", "tool/timeout_frac", "tool/seconds", "rollout/turns_mean",
             "rollout/void_turn_frac", "rollout/observation_token_frac")


def tool_scalars(samples: Sequence[Sample]) -> dict[str, float]:
    """TOOL_TAGS: calls per sample; the calls' error and timeout fractions and mean sandbox seconds; turns per
    sample; the fraction of samples with a void turn; observation tokens / response tokens (response_length/*
    count both)."""
    traced = [s for s in samples if s.tool is not None]
    if not traced:
        return {}
    statuses = [st for s in traced for st in s.tool.statuses]
    seconds = [x for s in traced for x in s.tool.seconds]
    calls = max(len(statuses), 1)
    observed = sum(end - start for s in traced for start, end in s.tool.observations)
    return {"tool/calls_per_sample": len(statuses) / len(traced),
            "tool/error_frac": statuses.count("error") / calls,
            "tool/timeout_frac": statuses.count("timeout") / calls,
            "tool/seconds": sum(seconds) / calls,
            "rollout/turns_mean": sum(s.tool.turns for s in traced) / len(traced),
            "rollout/void_turn_frac": sum(s.void_turn for s in traced) / len(traced),
            "rollout/observation_token_frac": observed / max(sum(s.response_len for s in traced), 1)}
