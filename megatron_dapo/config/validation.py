"""Cross-field and range checks of a config, all problems reported at once, before anything heavy loads."""

from __future__ import annotations

import os

from megatron_dapo.config.ranges import range_problems
from megatron_dapo.config.schema import AlgoConfig, Config, ConfigError


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Range and cross-field checks; raises ConfigError listing every problem found, on one line."""
    problems = _problems(cfg)
    if world_size is not None:
        problems += _layout_problems(cfg, world_size)
    if problems:
        raise ConfigError("invalid config: " + "; ".join(problems))


def data_parallel_size(cfg: Config, world_size: int) -> int:
    return world_size // (cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel)


def _problems(cfg: Config) -> list[str]:
    """The range of every numeric field (config/ranges.py), then the checks across fields."""
    p = range_problems(cfg)
    a, t, r = cfg.algo, cfg.train, cfg.rollout
    if t.prompt_batch_size % max(t.mini_batch_size, 1):
        p.append(f"train.mini_batch_size={t.mini_batch_size} must divide "
                 f"train.prompt_batch_size={t.prompt_batch_size}")
    if a.kl_coef != 0.0:
        p.append(f"algo.kl_coef={a.kl_coef}: DAPO removes the KL term; only 0 is supported")
    p += _correction_problems(a)
    if cfg.reward.soft_overlong_punishment and not 0 < cfg.reward.overlong_cache_len < r.max_response_len:
        p.append(f"reward.overlong_cache_len={cfg.reward.overlong_cache_len} must be in "
                 f"(0, rollout.max_response_len={r.max_response_len})")
    if cfg.parallel.sequence_parallel and cfg.parallel.tensor_parallel == 1:
        p.append("parallel.sequence_parallel needs parallel.tensor_parallel > 1")
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "none") and not os.path.isdir(resume):
        p.append(f"checkpoint.resume={resume!r} must be auto, none or an existing checkpoint folder")
    return p


def _correction_problems(a: AlgoConfig) -> list[str]:
    """Dual-clip and rollout-correction ranges."""
    p: list[str] = []
    high, low = a.rollout_correction_threshold, a.rollout_correction_threshold_low
    if not high > 0:  # reported by its range
        pass
    elif low is not None and not 0 < low < high:
        p.append(f"algo.rollout_correction_threshold_low={low} must be in "
                 f"(0, algo.rollout_correction_threshold={high})")
    elif low is None and a.rollout_correction.endswith("_mis") and not high > 1:
        p.append(f"algo.rollout_correction_threshold={high} must be > 1 for {a.rollout_correction} "
                 "(the default band's lower end is 1 / threshold)")
    if a.rollout_correction != "none" and a.old_logprob_source == "rollout":
        p.append(f"algo.rollout_correction={a.rollout_correction} with algo.old_logprob_source=rollout: "
                 "pi_old is the rollout policy then, so every correction weight would be 1")
    return p


def _layout_problems(cfg: Config, world_size: int) -> list[str]:
    tp, pp = cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel
    if world_size % (tp * pp):
        return [f"TP({tp}) x PP({pp}) = {tp * pp} does not divide world size {world_size}"]
    dp = data_parallel_size(cfg, world_size)
    if cfg.train.mini_batch_size % dp:
        return [f"train.mini_batch_size={cfg.train.mini_batch_size} must divide by DP={dp} "
                f"(world {world_size} / TP {tp} / PP {pp})"]
    return []
