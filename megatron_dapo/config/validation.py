"""Cross-field and range checks of a config, all problems reported at once, before anything heavy loads."""

from __future__ import annotations

import os

from megatron_dapo.config.schema import AlgoConfig, Config, ConfigError


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Cross-field checks; raises ConfigError listing every problem found."""
    problems = _problems(cfg)
    if world_size is not None:
        problems += _layout_problems(cfg, world_size)
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))


def data_parallel_size(cfg: Config, world_size: int) -> int:
    return world_size // (cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel)


def _problems(cfg: Config) -> list[str]:
    p: list[str] = []
    a, t, r, o = cfg.algo, cfg.train, cfg.rollout, cfg.actor.optimizer
    _positive(p, {"parallel.tensor_parallel": cfg.parallel.tensor_parallel,
                  "parallel.pipeline_parallel": cfg.parallel.pipeline_parallel,
                  "train.prompt_batch_size": t.prompt_batch_size, "train.mini_batch_size": t.mini_batch_size,
                  "rollout.max_response_len": r.max_response_len, "rollout.max_prompt_len": r.max_prompt_len,
                  "algo.max_gen_rounds": a.max_gen_rounds, "algo.epochs_per_rollout": a.epochs_per_rollout,
                  "actor.micro_batch_tokens": cfg.actor.micro_batch_tokens,
                  "actor.logprob_micro_batch_tokens": cfg.actor.logprob_micro_batch_tokens,
                  "rollout.weight_sync_bucket_mb": r.weight_sync_bucket_mb,
                  "eval.n_samples": cfg.eval.n_samples, "optimizer.lr": o.lr})
    if a.group_size < 2:
        p.append(f"algo.group_size={a.group_size}: group advantages need G >= 2")
    if t.prompt_batch_size % max(t.mini_batch_size, 1):
        p.append(f"train.mini_batch_size={t.mini_batch_size} must divide "
                 f"train.prompt_batch_size={t.prompt_batch_size}")
    if not 0.0 <= a.eps_low < 1.0:
        p.append(f"algo.eps_low={a.eps_low} must be in [0, 1)")
    if a.eps_high < 0.0:
        p.append(f"algo.eps_high={a.eps_high} must be >= 0")
    if a.kl_coef != 0.0:
        p.append(f"algo.kl_coef={a.kl_coef}: DAPO removes the KL term; only 0 is supported")
    p += _correction_problems(a)
    if a.gen_batch_multiplier < 1.0:
        p.append(f"algo.gen_batch_multiplier={a.gen_batch_multiplier} must be >= 1")
    if cfg.reward.soft_overlong_punishment and not 0 < cfg.reward.overlong_cache_len < r.max_response_len:
        p.append(f"reward.overlong_cache_len={cfg.reward.overlong_cache_len} must be in "
                 f"(0, rollout.max_response_len={r.max_response_len})")
    for key, top_p in (("rollout.top_p", r.top_p), ("eval.top_p", cfg.eval.top_p)):
        if not 0.0 < top_p <= 1.0:
            p.append(f"{key}={top_p} must be in (0, 1]")
    for key, temp in (("rollout.temperature", r.temperature), ("eval.temperature", cfg.eval.temperature)):
        if temp < 0.0:
            p.append(f"{key}={temp} must be >= 0")
    if o.warmup_steps < 0 or o.grad_clip < 0 or o.weight_decay < 0:
        p.append("actor.optimizer: warmup_steps, grad_clip and weight_decay must be >= 0")
    if cfg.parallel.sequence_parallel and cfg.parallel.tensor_parallel == 1:
        p.append("parallel.sequence_parallel needs parallel.tensor_parallel > 1")
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "none") and not os.path.isdir(resume):
        p.append(f"checkpoint.resume={resume!r} must be auto, none or an existing checkpoint folder")
    if r.max_inflight_groups < 0:
        p.append(f"rollout.max_inflight_groups={r.max_inflight_groups} must be >= 0 (0 = automatic)")
    if r.sglang.num_servers < 0:
        p.append(f"rollout.sglang.num_servers={r.sglang.num_servers} must be >= 0 (0 = fill the node)")
    if not 0.0 < r.sglang.mem_fraction_static < 1.0:
        p.append(f"rollout.sglang.mem_fraction_static={r.sglang.mem_fraction_static} must be in (0, 1)")
    if cfg.checkpoint.keep_last < 1:
        p.append(f"checkpoint.keep_last={cfg.checkpoint.keep_last} must be >= 1")
    return p


def _correction_problems(a: AlgoConfig) -> list[str]:
    """Dual-clip and rollout-correction ranges."""
    p: list[str] = []
    if a.clip_ratio_c is not None and not a.clip_ratio_c > 1.0:
        p.append(f"algo.clip_ratio_c={a.clip_ratio_c} must be > 1 (or null for no dual-clip)")
    high, low = a.rollout_correction_threshold, a.rollout_correction_threshold_low
    if not high > 0:
        p.append(f"algo.rollout_correction_threshold={high} must be > 0")
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


def _positive(p: list[str], values: dict[str, float]) -> None:
    p.extend(f"{k}={v} must be > 0" for k, v in values.items() if not v > 0)


def _layout_problems(cfg: Config, world_size: int) -> list[str]:
    tp, pp = cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel
    if world_size % (tp * pp):
        return [f"TP({tp}) x PP({pp}) = {tp * pp} does not divide world size {world_size}"]
    dp = data_parallel_size(cfg, world_size)
    if cfg.train.mini_batch_size % dp:
        return [f"train.mini_batch_size={cfg.train.mini_batch_size} must divide by DP={dp} "
                f"(world {world_size} / TP {tp} / PP {pp})"]
    return []
