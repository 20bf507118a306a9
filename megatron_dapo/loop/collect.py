"""One step's rollout on the driver rank: generate G samples per prompt, score them, and keep generating
rounds until dynamic sampling holds N informative groups; and the validation pass (evaluation.py:
avg@k, pass@k, maj@k).

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
from megatron_dapo.config import AlgoConfig, Config
from megatron_dapo.loop.evaluation import EvalResult, generate_and_score, generate_groups, score_group
from megatron_dapo.reward.scorer import Scorer
from megatron_dapo.rollout.base import RolloutEngine, SamplingParams
from megatron_dapo.types import Group, Prompt, Sample


@dataclass
class StepRollout:
    """The groups to train on, plus everything generated this step (for the monitors)."""

    groups: list[Group]
    stats: DynamicSamplingStats
    generated: list[Group] = field(default_factory=list)
    reward_seconds: float = 0.0
    generate_seconds: float = 0.0
    reward_failures: int = 0

    def monitors(self) -> dict[str, float]:
        """perf/rollout_tokens_per_s (generated tokens / generation time) and reward/failures."""
        tokens = sum(s.response_len for g in self.generated for s in g.samples)
        speed = tokens / self.generate_seconds if self.generate_seconds > 0 else 0.0
        return {"perf/rollout_tokens_per_s": speed, "reward/failures": float(self.reward_failures)}


def stamp(samples: list[Sample], version: int, before: tuple[Sample, ...] = ()) -> None:
    """Record that `version` made each sample's tokens after those of `before[k]` (the sample as it was
    carried in: its spans are kept); a sample with no span gets (0, version)."""
    for k, s in enumerate(samples):
        prior = before[k] if k < len(before) else None
        spans = list(prior.versions) if prior is not None else []
        start = prior.response_len if prior is not None else 0
        if s.response_len > start or not spans:
            spans.append((start, version))
        s.versions = spans


def seed_of(*parts: Any) -> int:
    """A 32-bit seed that is a pure function of `parts` (stable across processes and resumes)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")


def step_sampling(cfg: Config, step: int, round_idx: int, eos_ids: tuple[int, ...]) -> SamplingParams:
    """Training-rollout sampling; the seed is a pure function of (seed, step, round) so resumes replay."""
    return SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                          max_new_tokens=cfg.rollout.max_response_len, stop_token_ids=eos_ids,
                          seed=seed_of(cfg.train.seed, "train", step, round_idx))


def eval_sampling(cfg: Config, eos_ids: tuple[int, ...], prompt: int) -> SamplingParams:
    """Validation sampling (eval temperature / top-p) of validation prompt `prompt`: its seed is a pure
    function of (train.seed, prompt), the same at every evaluation."""
    e = cfg.eval
    return SamplingParams(temperature=e.temperature, top_p=e.top_p, max_new_tokens=cfg.rollout.max_response_len,
                          stop_token_ids=eos_ids, seed=seed_of(cfg.train.seed, "eval", prompt))


def collect_step(engine: RolloutEngine, tokenizer, next_prompts: Callable[[int], list[Prompt]], *,
                 target_groups: int, algo: AlgoConfig, scorer: Scorer,
                 sampling: Callable[[int], SamplingParams], version: int = 0) -> StepRollout:
    """Rounds of generate + score until the sampler is done; `sampling(round)` seeds each round; every
    sample is stamped with `version` (the engine's policy version)."""
    sampler = DynamicSampler(target_groups, algo.max_gen_rounds, algo.on_rounds_exhausted, algo.dynamic_sampling,
                             metric=algo.filter_metric)
    first = math.ceil(target_groups * algo.gen_batch_multiplier)
    generated: list[Group] = []
    round_idx, reward_seconds, generate_seconds = 0, 0.0, 0.0
    while not sampler.done:
        prompts = next_prompts(sampler.next_round_size(first))
        t0 = time.perf_counter()
        groups = generate_groups(engine, tokenizer, prompts, algo.group_size, sampling(round_idx))
        round_idx += 1
        t1 = time.perf_counter()
        for g in groups:
            stamp(g.samples, version)
            score_group(g, tokenizer, scorer)
        generate_seconds += t1 - t0
        reward_seconds += time.perf_counter() - t1
        generated += groups
        sampler.add_round(groups)
    engine.abort()  # nothing should be left running; drop leftovers of an engine that streams
    kept, stats = sampler.finish()
    return StepRollout(kept, stats, generated, reward_seconds, generate_seconds, scorer.take_failures())


def evaluate(engine: RolloutEngine, tokenizer, prompts: list[Prompt], cfg: Config, eos_ids: tuple[int, ...],
             scorer: Scorer) -> EvalResult:
    """k = eval.n_samples scored samples per validation prompt (eval temperature / top-p)."""
    t0 = time.perf_counter()
    groups = generate_and_score(engine, tokenizer, prompts, cfg.eval.n_samples,
                                lambda i: eval_sampling(cfg, eos_ids, i), scorer)
    return EvalResult(groups, cfg.eval.n_samples, seconds=time.perf_counter() - t0)
