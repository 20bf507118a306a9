"""One step's streaming rollout (`rollout.streaming`): dynamic sampling on a stream of groups.

Groups are submitted to the engine's `RolloutStream` and come back one by one as their G samples are
done. Each is scored on arrival and kept if informative; the stream is kept topped up to
`gen_batch_multiplier x missing / kept fraction` groups in flight (at most `rollout.max_inflight_groups`;
the fraction is Laplace-smoothed over this step's finished groups); as soon as N groups are kept the
rest is aborted. The step's group budget is `algo.max_gen_rounds` rounds' worth:
max_gen_rounds x ceil(N x gen_batch_multiplier) groups. With dynamic sampling off exactly N groups run,
all kept.

Reproducibility: group g of step s has the g-th prompt the data iterator gives that step and sampling
seed f(train.seed, step, g), so its samples are a pure function of (seed, step, g) whatever finishes
first (engines permitting: see rollout/embedded/continuous.py and rollout/sglang/stream.py). WHICH groups are
kept (the first N informative to finish), and so how far the data iterator advances, follows completion
order: on the embedded engine that order is itself deterministic (its stream is one synchronous decode
loop), on SGLang servers it is timing. Aborted groups' prompts are consumed, as in slime. Groups that
finish early are favoured: over-sampled long responses are the ones aborted.

Partial rollout (`rollout.partial_rollout`): the aborted groups are not dropped. The
abort report holds each one's samples so far; the next step submits them first (`carry`), and their
responses continue where they stopped, under the new weights. Their earlier tokens keep the logprobs of
the policy that sampled them: the actor recomputes pi_old over the whole response, and the rollout-
correction weights (`algo.rollout_correction`, when on) account for the gap. The carry is part of the
checkpoint. A group is carried into at most `rollout.max_carry_steps` later steps (0: no bound), so no token
is more than that many policy updates stale; one still unfinished then is dropped (its tokens wasted).

Fully async (`rollout.async_mode=stream`, `weights`): newer weights interrupt the stream. Whoever publishes
them aborts it while `next()` waits (`weights.waiting`: at the engine's next decode step), or the stream
aborts itself before its next submission; either way the groups in flight come back with their samples so
far, the engine takes the weights, and the groups are resubmitted to continue from where they stopped. Each
sample records which version made which of its tokens (`Sample.versions`); rollout/weight_updates and
rollout/interrupted_groups count the hand-overs.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from megatron_dapo.algo.dynamic_sampling import DynamicSampler, DynamicSamplingStats
from megatron_dapo.config import AlgoConfig
from megatron_dapo.config.schema import FilterMetric, OnExhausted
from megatron_dapo.rollout.base import (
    AbortReport,
    EngineStateError,
    GenerationAborted,
    GroupRequest,
    GroupResult,
    RolloutEngine,
    RolloutStream,
    SamplingParams,
)
from megatron_dapo.collect.carry import PartialCarry
from megatron_dapo.collect.result import StreamRollout
from megatron_dapo.collect.scoring import RenderedPrompt
from megatron_dapo.collect.versions import stamp
from megatron_dapo.types import Group, Prompt


@dataclass(kw_only=True)
class StreamPlan:
    """How many groups to keep, start, have in flight and spend at most in one step."""

    target_groups: int
    first: int
    """Groups in flight before any has finished."""
    oversample: float = 1.0
    """In flight = oversample x missing / kept fraction."""
    max_inflight: int
    max_groups: int
    """The step's group budget."""
    dynamic_sampling: bool = True
    metric: FilterMetric = "acc"
    on_exhausted: OnExhausted = "train_partial"
    partial: bool = False
    """Partial rollout: hand the aborted groups, as far as they got, to the next step."""
    max_carry_steps: int = 0
    """Partial rollout: drop a group aborted again after this many carries (0: no bound)."""

    @classmethod
    def from_config(cls, algo: AlgoConfig, target_groups: int, max_inflight_groups: int = 0,
                    partial: bool = False, max_carry_steps: int = 0) -> StreamPlan:
        first = math.ceil(target_groups * algo.gen_batch_multiplier)
        carry: dict[str, Any] = {"partial": partial, "max_carry_steps": max_carry_steps}
        if not algo.dynamic_sampling:
            return cls(target_groups=target_groups, first=target_groups, max_inflight=target_groups,
                       max_groups=target_groups, dynamic_sampling=False, **carry)
        return cls(target_groups=target_groups, first=first, oversample=algo.gen_batch_multiplier,
                   max_inflight=max_inflight_groups or 2 * first, max_groups=algo.max_gen_rounds * first,
                   metric=algo.filter_metric, on_exhausted=algo.on_rounds_exhausted, **carry)

    def sampler(self) -> DynamicSampler:
        """The step's dynamic sampler (algo/dynamic_sampling.py): what is kept, the sizing, the verdict."""
        return DynamicSampler(self.target_groups, max(1, math.ceil(self.max_groups / self.first)),
                              self.on_exhausted, self.dynamic_sampling, metric=self.metric)

    def inflight(self, sampler: DynamicSampler) -> int:
        """Groups that should be in flight now."""
        return sampler.inflight(self.first, self.oversample, self.max_inflight)


class LiveWeights(Protocol):
    """Weights that may change mid-batch (schedule/pipeline.py): the engine's `version`, whether newer
    ones were published, `refresh` (the engine takes them; nothing may be in flight); `waiting(stream)`
    wraps each `next()`, during which the publisher may abort the stream (`interruption` takes its report)."""

    version: int

    def fresher(self) -> bool: ...

    def refresh(self) -> None: ...

    def waiting(self, stream: RolloutStream) -> AbstractContextManager: ...

    def interruption(self) -> AbortReport | None: ...


class RolloutStepError(RuntimeError):
    """The engine failed mid-stream; `partial` holds everything the step had received and kept."""

    def __init__(self, message: str, partial: StreamRollout) -> None:
        super().__init__(message)
        self.partial = partial


def collect_stream(engine: RolloutEngine, next_prompt: Callable[[], RenderedPrompt],
                   score: Callable[[Group], None], sampling: Callable[[int], SamplingParams], plan: StreamPlan, *,
                   group_size: int, carry: PartialCarry | None = None, version: int = 0,
                   weights: LiveWeights | None = None) -> StreamRollout:
    """The trainer's stream, with the same callables as `collect_rounds`: group g is `next_prompt()`'s
    next prompt, its `group_size` samples drawn with `sampling(g)` (its seed)."""

    def request(g: int) -> tuple[Prompt, GroupRequest]:
        prompt, ids = next_prompt()
        return prompt, GroupRequest(key=g, prompt_ids=ids, n=group_size, sampling=sampling(g))

    return stream_groups(engine, request, score, plan, carry, version, weights)


def stream_groups(engine: RolloutEngine, request: Callable[[int], tuple[Prompt, GroupRequest]],
                  score: Callable[[Group], None], plan: StreamPlan, carry: PartialCarry | None = None,
                  version: int = 0, weights: LiveWeights | None = None) -> StreamRollout:
    """Stream groups `request(0), request(1), ...` through `engine` until `plan` is met (module docstring).
    The groups of `carry` (partial rollout) go first, as groups 0 .. len(carry) - 1, and the result's carry is
    the next step's. Samples are stamped with `version` (the engine's policy version; `weights.version`
    when the weights may change mid-batch) from where they were carried in."""
    t0 = time.perf_counter()
    sampler = plan.sampler()
    out = StreamRollout(groups=sampler.kept, stats=DynamicSamplingStats(0, 0, 0, 0.0, False))
    out.stream.live = weights is not None
    version = weights.version if weights is not None else version
    prompts: dict[int, Prompt] = {}
    requests: dict[int, GroupRequest] = {}

    def submit(stream, items: list[tuple[Prompt, GroupRequest]]) -> None:
        for prompt, req in items:
            prompts[req.key], requests[req.key] = prompt, req
        out.stream.submitted += len(items)
        if items:
            stream.submit([req for _, req in items])

    interrupted: AbortReport | None = None

    def aborted(stream) -> AbortReport:
        """The groups in flight, cancelled: by the publisher of newer weights, or now."""
        nonlocal interrupted
        report = interrupted or (weights.interruption() if weights is not None else None)
        interrupted = None
        return report if report is not None else stream.abort()

    def refresh(stream) -> int:
        """The newer weights: the groups in flight aborted, the engine updated, the groups resubmitted."""
        report = aborted(stream)
        _check_partial(stream, report)
        for k in report.keys:
            stamp(report.partial[k], version, requests[k].resume)
            requests[k] = dataclasses.replace(requests[k], resume=tuple(report.partial[k]))
        weights.refresh()
        out.stream.generated_tokens += report.tokens
        out.stream.weight_updates += 1
        out.stream.interrupted_groups += len(report.keys)
        if report.keys:
            stream.submit([requests[k] for k in report.keys])
        return weights.version

    with engine.stream() as stream:
        try:
            submit(stream, [(p, dataclasses.replace(r, key=g)) for g, (p, r) in enumerate(carry or ())])
            out.stream.resumed_groups, out.stream.partial = len(carry or ()), plan.partial
            while len(out.groups) < plan.target_groups:
                if weights is not None and weights.fresher():
                    version = refresh(stream)
                wanted = plan.inflight(sampler) - stream.pending
                fresh = max(0, min(wanted, plan.max_groups - out.stream.submitted))
                submit(stream, [request(out.stream.submitted + i) for i in range(fresh)])
                if not stream.pending:
                    break  # the group budget is spent
                result = next_group(stream, weights)
                if isinstance(result, AbortReport):
                    interrupted = result
                    continue  # newer weights: the groups resume on them
                group = Group(prompt=prompts.pop(result.key), samples=result.samples)
                stamp(group.samples, version, requests[result.key].resume)
                t = time.perf_counter()
                score(group)
                out.reward_seconds += time.perf_counter() - t
                out.generated.append(group)
                out.stream.generated_tokens += result.tokens - requests[result.key].resumed_tokens
                if sampler.offer(group) and len(out.groups) == 1:
                    out.stream.first_kept_s = time.perf_counter() - t0
        except Exception as e:
            report = aborted(stream)
            _finish(out, report, sampler, plan, report.tokens, verdict=False)
            raise RolloutStepError(
                f"streaming rollout failed after keeping {len(out.groups)}/{plan.target_groups} groups "
                f"({len(out.generated)} finished, {out.stream.submitted} submitted): {e}", out) from e
        report = aborted(stream)  # without partial rollout the tokens made before a mid-batch update go too:
        wasted = report.tokens + sum(requests[k].resumed_tokens for k in report.keys)
        if plan.partial:
            _check_partial(stream, report)
            for k in report.keys:
                stamp(report.partial[k], version, requests[k].resume)
            cut = [(prompts[k], dataclasses.replace(requests[k], resume=tuple(report.partial[k]),
                                                  carried_steps=requests[k].carried_steps + 1))
                   for k in report.keys]
            stale = [0 < plan.max_carry_steps < r.carried_steps for _, r in cut]
            out.carry = PartialCarry([c for c, old in zip(cut, stale) if not old])
            out.stream.dropped_stale_groups = sum(stale)
            wasted = sum(r.resumed_tokens for (_, r), old in zip(cut, stale) if old)
        _finish(out, report, sampler, plan, wasted)
    out.generate_seconds = time.perf_counter() - t0 - out.reward_seconds
    return out


def next_group(stream: RolloutStream, weights: LiveWeights | None) -> GroupResult | AbortReport:
    """`stream.next()`, or the report of the abort by which the publisher of newer weights ended it."""
    if weights is None:
        return stream.next()
    with weights.waiting(stream):
        try:
            return stream.next()
        except (GenerationAborted, EngineStateError):  # aborted while waiting, or just before
            report = weights.interruption()
            if report is None:
                raise
            return report


def _check_partial(stream, report: AbortReport) -> None:
    if set(report.partial) != set(report.keys):
        raise RuntimeError(f"partial rollout: {type(stream).__name__} did not report every aborted group's samples "
                           f"({sorted(report.partial)} of {report.keys})")


def _finish(out: StreamRollout, report: AbortReport, sampler: DynamicSampler, plan: StreamPlan, wasted: int,
            verdict: bool = True) -> None:
    out.stream.aborted_groups = len(report.keys)
    out.stream.carried_groups = len(out.carry)
    out.stream.carried_tokens = out.carry.tokens
    out.stream.wasted_tokens = wasted
    started = [x.response_len for k in report.keys for x in report.partial.get(k, ()) if x.response_len]
    out.stream.aborted_response_len = sum(started) / len(started) if started else math.nan
    out.stream.generated_tokens += report.tokens
    _, out.stats = sampler.finish(budget=f"{out.stream.submitted}/{plan.max_groups} streamed groups",
                                  seen_as="finished", rounds=math.ceil(out.stream.submitted / plan.first),
                                  verdict=verdict)


