"""One step's rollout on the driver rank: generate G samples per prompt, score them, and keep generating
rounds until dynamic sampling holds N informative groups; and the validation pass (avg@k).

Sampling seeds are pure functions of (train.seed, step, round), so a resumed run replays the same samples.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_dapo.algo.dynamic_sampling import DynamicSampler, DynamicSamplingStats
from megatron_dapo.config import AlgoConfig, Config, RewardConfig
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


def seed_of(*parts: Any) -> int:
    """A 32-bit seed that is a pure function of `parts` (stable across processes and resumes)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")


def step_sampling(cfg: Config, step: int, round_idx: int, eos_ids: tuple[int, ...]) -> SamplingParams:
    """Training-rollout sampling; the seed is a pure function of (seed, step, round) so resumes replay."""
    return SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                          max_new_tokens=cfg.rollout.max_response_len, stop_token_ids=eos_ids,
                          seed=seed_of(cfg.train.seed, "train", step, round_idx))


def eval_sampling(cfg: Config, eos_ids: tuple[int, ...]) -> SamplingParams:
    """Validation sampling (eval temperature / top-p), the same seed at every evaluation."""
    e = cfg.eval
    return SamplingParams(temperature=e.temperature, top_p=e.top_p, max_new_tokens=cfg.rollout.max_response_len,
                          stop_token_ids=eos_ids, seed=seed_of(cfg.train.seed, "eval"))


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
    sampler = DynamicSampler(target_groups, algo.max_gen_rounds, algo.on_rounds_exhausted, algo.dynamic_sampling,
                             metric=algo.filter_metric)
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


def evaluate(engine: RolloutEngine, tokenizer, prompts: list[Prompt], cfg: Config,
             eos_ids: tuple[int, ...]) -> dict[str, float]:
    """avg@k: mean accuracy over k samples per validation prompt (eval temperature / top-p)."""
    groups = generate_groups(engine, tokenizer, prompts, cfg.eval.n_samples, eval_sampling(cfg, eos_ids))
    for g in groups:
        score_group(g, tokenizer, cfg.reward, cfg.rollout.max_response_len)
    samples = [s for g in groups for s in g.samples]
    return {"val/acc_avg_at_k": _mean([float(s.acc) for s in samples]),
            "val/response_length_mean": _mean([s.response_len for s in samples])}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
