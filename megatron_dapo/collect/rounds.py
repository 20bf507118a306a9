"""One step's rollout in synchronous rounds (`rollout.streaming=false`, the paper's Algorithm 1): generate G
samples for a round of prompts, score them, and generate more rounds until dynamic sampling holds N
informative groups. Round r's samples share one seed, `sampling(r)`."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from megatron_dapo.algo.dynamic_sampling import DynamicSampler, is_informative
from megatron_dapo.config import AlgoConfig
from megatron_dapo.rollout.base import RolloutEngine, SamplingParams
from megatron_dapo.collect.result import StepRollout
from megatron_dapo.collect.scoring import RenderedPrompt
from megatron_dapo.collect.versions import stamp
from megatron_dapo.types import Group


def collect_rounds(engine: RolloutEngine, next_prompt: Callable[[], RenderedPrompt], score: Callable[[Group], None],
                   sampling: Callable[[int], SamplingParams], *, algo: AlgoConfig, target_groups: int,
                   version: int = 0) -> StepRollout:
    """Rounds of generate + score until the sampler is done; every sample is stamped with `version` (the
    engine's policy version). The same callables as `collect_stream`, except that sampling is per round."""
    sampler = DynamicSampler(target_groups, algo.max_gen_rounds, algo.on_rounds_exhausted, algo.dynamic_sampling,
                             metric=algo.filter_metric)
    first = math.ceil(target_groups * algo.gen_batch_multiplier)
    generated: list[Group] = []
    round_idx, reward_seconds, generate_seconds = 0, 0.0, 0.0
    while not sampler.done:
        prompts = [next_prompt() for _ in range(sampler.next_round_size(first))]
        t0 = time.perf_counter()
        samples = engine.generate([ids for _, ids in prompts], algo.group_size, sampling(round_idx))
        groups = [Group(prompt=p, samples=s) for (p, _), s in zip(prompts, samples)]
        round_idx += 1
        t1 = time.perf_counter()
        for g in groups:
            stamp(g.samples, version)
            score(g)
        generate_seconds += t1 - t0
        reward_seconds += time.perf_counter() - t1
        generated += groups
        sampler.add_round(groups)
    engine.abort()  # nothing should be left running; drop leftovers of an engine that streams
    kept, stats = sampler.finish()
    return StepRollout(kept, stats, generated, reward_seconds, generate_seconds,
                       wasted_tokens=surplus_tokens(generated, kept, algo))


def surplus_tokens(generated: list[Group], kept: list[Group], algo: AlgoConfig) -> int:
    """Tokens of the groups generated that would have been trained on but were trimmed beyond N: the
    informative ones (any, with dynamic sampling off)."""
    ids = {id(g) for g in kept}
    return sum(s.response_len for g in generated if id(g) not in ids
               and (is_informative(g, algo.filter_metric) or not algo.dynamic_sampling) for s in g.samples)
