"""A step's rollout as the collectors hand it over: the groups to train on, everything generated (for the
monitors), what it cost; each kind reports its own monitors (`scalars`). As plain JSON for a checkpoint
that holds a batch generated and not yet trained on (off-policy pipelining)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_dapo.algo.dynamic_sampling import DynamicSamplingStats
from megatron_dapo.collect.carry import PartialCarry
from megatron_dapo.rollout.tools.monitors import tool_scalars
from megatron_dapo.types import Group


@dataclass
class StepRollout:
    """Rounds (`rollout.streaming=false`): the kept groups, all generated groups, timings and cost."""

    groups: list[Group]
    stats: DynamicSamplingStats
    generated: list[Group] = field(default_factory=list)
    reward_seconds: float = 0.0
    generate_seconds: float = 0.0
    reward_failures: int = 0
    wasted_tokens: int = 0
    """Tokens of the groups generated and trimmed beyond N (informative ones, or any with dynamic sampling off)."""

    @property
    def samples_generated(self) -> int:
        return sum(len(g.samples) for g in self.generated)

    def scalars(self) -> dict[str, float]:
        """Reward, accuracy, lengths, dynamic sampling, speed and cost over everything generated this step;
        timing/reward_s: the part of the rollout spent scoring."""
        samples = [s for g in self.generated for s in g.samples]
        lengths = [s.response_len for s in samples]
        return {"train/reward_mean": _mean([s.reward for s in samples]),
                "train/acc_mean": _mean([float(s.acc) for s in samples]),
                "response_length/mean": _mean(lengths), "response_length/max": float(max(lengths, default=0)),
                "response_length/clip_ratio": _mean([float(s.truncated) for s in samples]),
                "rollout/gen_rounds": float(self.stats.rounds), "rollout/kept_group_frac": self.stats.kept_frac,
                "rollout/exhausted": float(self.stats.exhausted),
                "perf/rollout_tokens_per_s": sum(lengths) / self.generate_seconds if self.generate_seconds > 0
                else 0.0,
                "reward/failures": float(self.reward_failures), "timing/reward_s": self.reward_seconds,
                **tool_scalars(samples), **self.cost()}

    def cost(self) -> dict[str, float]:
        """rollout/{aborted_groups,wasted_tokens,generated_tokens}: rounds abort nothing and waste the
        groups trimmed beyond N."""
        return {"rollout/aborted_groups": 0.0, "rollout/wasted_tokens": float(self.wasted_tokens),
                "rollout/generated_tokens": float(sum(s.response_len for g in self.generated for s in g.samples))}


@dataclass
class StreamStats:
    submitted: int = 0
    aborted_groups: int = 0
    wasted_tokens: int = 0
    """Tokens generated for groups that were aborted (partial, or finished but not collected) and not
    carried to the next step; a dropped stale group's tokens count in full, over every step that made them."""
    generated_tokens: int = 0
    """Tokens generated in this step (carried-in tokens count in the step that made them)."""
    partial: bool = False
    """Partial rollout was on (the carry monitors below are reported)."""
    resumed_groups: int = 0
    """Groups carried in from the previous step."""
    carried_groups: int = 0
    carried_tokens: int = 0
    """Groups handed to the next step and the response tokens they take along."""
    dropped_stale_groups: int = 0
    """Aborted groups not carried on: they had been carried max_carry_steps times already."""
    live: bool = False
    """Fully async (rollout.async_mode=stream): the weights could change mid-batch (reported below)."""
    weight_updates: int = 0
    interrupted_groups: int = 0
    """Fully async: how often the engine took newer weights during this batch, and the groups in flight then
    (aborted and resumed on the new weights; counted once per update)."""
    first_kept_s: float = math.nan
    """Seconds from the step's start to its first kept group."""
    aborted_response_len: float = math.nan
    """Mean length so far of the aborted groups' started samples (each would have run at least this long):
    set beside response_length/mean, how far the stream favours the responses that finish early."""


@dataclass
class StreamRollout(StepRollout):
    """Streaming (`rollout.streaming`): also what was aborted, carried, wasted."""

    stream: StreamStats = field(default_factory=StreamStats)
    carry: PartialCarry = field(default_factory=PartialCarry)

    def cost(self) -> dict[str, float]:
        """What the stream aborted and wasted; with partial rollout what it carried in and out; the first
        kept group's time and the aborted samples' mean length when there were some."""
        s = self.stream
        out = {"rollout/aborted_groups": float(s.aborted_groups), "rollout/wasted_tokens": float(s.wasted_tokens),
               "rollout/generated_tokens": float(s.generated_tokens)}
        if s.partial:
            out.update({"rollout/resumed_groups": float(s.resumed_groups),
                        "rollout/carried_groups": float(s.carried_groups),
                        "rollout/carried_tokens": float(s.carried_tokens),
                        "rollout/dropped_stale_groups": float(s.dropped_stale_groups)})
        if s.live:
            out.update({"rollout/weight_updates": float(s.weight_updates),
                        "rollout/interrupted_groups": float(s.interrupted_groups)})
        if not math.isnan(s.aborted_response_len):
            out["rollout/aborted_response_len"] = s.aborted_response_len
        if not math.isnan(s.first_kept_s):
            out["rollout/first_kept_s"] = s.first_kept_s
        return out


def rollout_state(r: StepRollout) -> dict:
    """A step's rollout as plain JSON (exact: floats by repr); a kept group that is one of `generated` as its
    index there (the monitors tell kept from generated by identity)."""
    index = {id(g): i for i, g in enumerate(r.generated)}
    out = {"kind": "stream" if isinstance(r, StreamRollout) else "rounds",
           "generated": [dataclasses.asdict(g) for g in r.generated],
           "kept": [index[id(g)] if id(g) in index else dataclasses.asdict(g) for g in r.groups],
           "stats": dataclasses.asdict(r.stats), "reward_seconds": r.reward_seconds,
           "generate_seconds": r.generate_seconds, "reward_failures": r.reward_failures,
           "wasted_tokens": r.wasted_tokens}
    if isinstance(r, StreamRollout):
        out.update(stream=dataclasses.asdict(r.stream), carry=r.carry.state_dict())
    return out


def load_rollout(d: dict) -> StepRollout:
    generated = [Group.from_dict(g) for g in d["generated"]]
    common = dict(groups=[generated[k] if isinstance(k, int) else Group.from_dict(k) for k in d["kept"]],
                  stats=DynamicSamplingStats(**d["stats"]), generated=generated, reward_seconds=d["reward_seconds"],
                  generate_seconds=d["generate_seconds"], reward_failures=d["reward_failures"],
                  wasted_tokens=d.get("wasted_tokens", 0))
    if d["kind"] == "stream":
        return StreamRollout(**common, stream=StreamStats(**d["stream"]), carry=PartialCarry.from_state(d["carry"]))
    return StepRollout(**common)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
