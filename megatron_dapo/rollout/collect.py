"""One step's rollout on the driver rank: generate G samples per prompt, score them, and keep
generating rounds until dynamic sampling holds N informative groups."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_dapo.algo.dynamic_sampling import DynamicSampler, DynamicSamplingStats
from megatron_dapo.config import AlgoConfig, RewardConfig
from megatron_dapo.data.render import decode_response, render_prompt_ids
from megatron_dapo.reward import compute_score, soft_overlong_penalty
from megatron_dapo.rollout.base import RolloutEngine, SamplingParams
from megatron_dapo.types import Group, Prompt


@dataclass
class StepRollout:
    """The groups to train on, plus everything generated this step (for the monitors)."""

    groups: list[Group]
    stats: DynamicSamplingStats
    generated: list[Group] = field(default_factory=list)
    reward_seconds: float = 0.0


def score_group(group: Group, tokenizer, reward: RewardConfig, max_response_len: int) -> None:
    """R_i = rule reward (eq. 7) + soft overlong punishment (eq. 13, if enabled), in place."""
    for s in group.samples:
        s.response_text = decode_response(tokenizer, s.response_ids)
        result = compute_score(s.response_text, group.prompt.ground_truth,
                               answer_fallback=reward.answer_fallback)
        s.acc, s.pred, s.reward = result.acc, result.pred, result.score
        if reward.soft_overlong_punishment:
            s.reward += soft_overlong_penalty(s.response_len, max_response_len, reward.overlong_cache_len,
                                              reward.overlong_penalty_factor)


def generate_groups(engine: RolloutEngine, tokenizer, prompts: list[Prompt], n: int,
                    sampling: SamplingParams) -> list[Group]:
    ids = [render_prompt_ids(tokenizer, p) for p in prompts]
    return [Group(prompt=p, samples=s) for p, s in zip(prompts, engine.generate(ids, n, sampling))]


def collect_step(engine: RolloutEngine, tokenizer, next_prompts: Callable[[int], list[Prompt]], *,
                 target_groups: int, algo: AlgoConfig, reward: RewardConfig, max_response_len: int,
                 sampling: Callable[[int], SamplingParams]) -> StepRollout:
    """Rounds of generate + score until the sampler is done; `sampling(round)` seeds each round."""
    sampler = DynamicSampler(target_groups, algo.max_gen_rounds, algo.on_rounds_exhausted, algo.dynamic_sampling)
    first = math.ceil(target_groups * algo.gen_batch_multiplier)
    generated: list[Group] = []
    round_idx, reward_seconds = 0, 0.0
    while not sampler.done:
        prompts = next_prompts(sampler.next_round_size(first))
        groups = generate_groups(engine, tokenizer, prompts, algo.group_size, sampling(round_idx))
        round_idx += 1
        t0 = time.perf_counter()
        for g in groups:
            score_group(g, tokenizer, reward, max_response_len)
        reward_seconds += time.perf_counter() - t0
        generated += groups
        sampler.add_round(groups)
    engine.abort()  # nothing should be left running; drop leftovers of an engine that streams
    kept, stats = sampler.finish()
    return StepRollout(kept, stats, generated, reward_seconds)
