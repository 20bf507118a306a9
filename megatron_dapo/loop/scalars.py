"""The step's monitors (the paper's §4.3 dashboard) as pure functions of what the step produced."""

from __future__ import annotations

import math

import torch

from megatron_dapo.loop.collect import StepRollout
from megatron_dapo.types import TrainBatch


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def rollout_scalars(rollout: StepRollout, *, samples_total: int, groups_trained: int) -> dict[str, float]:
    """Reward, accuracy, lengths and dynamic-sampling figures over everything generated this step."""
    samples = [s for g in rollout.generated for s in g.samples]
    lengths = [s.response_len for s in samples]
    return {"rollout/samples_total": float(samples_total),
            "train/reward_mean": _mean([s.reward for s in samples]),
            "train/acc_mean": _mean([float(s.acc) for s in samples]),
            "response_length/mean": _mean(lengths), "response_length/max": float(max(lengths, default=0)),
            "response_length/clip_ratio": _mean([float(s.truncated) for s in samples]),
            "rollout/gen_rounds": float(rollout.stats.rounds),
            "rollout/kept_group_frac": rollout.stats.kept_frac,
            "rollout/groups_trained": float(groups_trained),
            "rollout/exhausted": float(rollout.stats.exhausted)}


def token_sums(batch: TrainBatch, entropy: torch.Tensor | None) -> torch.Tensor:
    """[entropy, generation prob, |pi_old - pi_rollout|, tokens] summed over generated tokens (float64):
    the numerators of the token-mean monitors, to be summed over data-parallel ranks. Without an
    entropy (no pi_old pass ran) its sum is NaN and `update_scalars` takes the update's entropy."""
    gen = batch.response_mask
    ent = float("nan") if entropy is None else float((entropy * gen).sum())
    return torch.tensor([ent, float((batch.rollout_logprobs.exp() * gen).sum()),
                         float(((batch.old_logprobs - batch.rollout_logprobs).abs() * gen).sum()),
                         float(gen.sum())], dtype=torch.float64)


def update_scalars(update: dict[str, float], sums: torch.Tensor) -> dict[str, float]:
    """The actor's update statistics plus the token means of `token_sums` (already summed over DP)."""
    ent, prob, diff, n = sums.tolist()
    n = max(n, 1.0)
    entropy = update["entropy"] if math.isnan(ent) else ent / n
    return {"actor/pg_loss": update["loss"], "actor/clipfrac_high": update["clipfrac_high"],
            "actor/clipfrac_low": update["clipfrac_low"], "actor/clipfrac_dual": update["clipfrac_dual"],
            "actor/grad_norm": update["grad_norm"], "actor/lr": update["lr"], "actor/approx_kl": update["approx_kl"],
            "actor/nonfinite": update["nonfinite"], "actor/entropy": entropy, "actor/mean_token_prob": prob / n,
            "rollout/train_rollout_logprob_absdiff": diff / n}


def step_timings(phase_seconds: dict[str, float], step_seconds: float, tokens: int,
                 weight_sync: dict[str, float] | None) -> dict[str, float]:
    """timing/<phase>_s per phase, the step's wall time, trained tokens per second, and the weight sync's
    byte counts (`SyncStats.scalars()`: perf/weight_sync_bytes, ..._sent_rank0, ..._cross_node)."""
    out = {f"timing/{k}_s": v for k, v in phase_seconds.items()}
    out.update(weight_sync or {})
    out["timing/step_s"] = step_seconds
    out["perf/tokens_per_s"] = tokens / step_seconds if step_seconds > 0 else 0.0
    return out
