"""pi_old for the step's batch, and the rollout-correction weights that compare it with pi_rollout.

`algo.old_logprob_source`: "recompute" runs the actor's forward pass over the batch (the exact pi_old
of the trainer); "rollout" takes the engine's logprobs as pi_old and skips that pass (then the
train-inference mismatch goes uncorrected and unmeasured). `algo.rollout_correction` multiplies each
token's loss term by TIS / MIS weights of pi_old / pi_rollout (algo/rollout_correction.py).
"""

from __future__ import annotations

import math

import torch

from megatron_dapo import parallel
from megatron_dapo.actor.actor import Actor
from megatron_dapo.algo.rollout_correction import correction_spec, correction_weights
from megatron_dapo.config import AlgoConfig
from megatron_dapo.types import TrainBatch


def old_logprobs(actor: Actor, batch: TrainBatch, algo: AlgoConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log pi_old [B, S], token entropies [B, S] or None when no forward pass ran)."""
    if algo.old_logprob_source == "rollout":
        return batch.rollout_logprobs.clone(), None
    return actor.compute_logprobs(batch)


def apply_rollout_correction(batch: TrainBatch, algo: AlgoConfig, correction: str) -> dict[str, float]:
    """Set `batch.is_weights` per `correction` (algo.rollout_correction resolved: Config.rollout_correction);
    return the rollout_corr/* monitors over all data-parallel ranks (a collective when DP > 1; nothing when
    the correction is off)."""
    spec = correction_spec(correction)
    if spec is None:
        return {}
    level, mode = spec
    weights, m = correction_weights(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask, level=level,
                                    mode=mode, threshold=algo.rollout_correction_threshold,
                                    threshold_low=algo.rollout_correction_threshold_low)
    batch.is_weights = weights
    units = m.num_seqs if level == "sequence" else m.num_tokens
    frac = m.clipped_frac if mode == "truncate" else m.masked_frac
    mean_d = -math.log(m.ppl_ratio)  # ppl_ratio = exp(-mean d): recover the token sum of d
    sums = parallel.dp_sum(torch.tensor([m.weight_mean * m.num_tokens, frac * units, m.kl_k3 * m.num_tokens,
                                         mean_d * m.num_tokens, m.num_tokens, units], dtype=torch.float64))
    peak = parallel.dp_max(torch.tensor([m.weight_max], dtype=torch.float64))
    w, f, kl, d, n, u = sums.tolist()
    n, u = max(n, 1.0), max(u, 1.0)
    name = "clipped_frac" if mode == "truncate" else "masked_frac"
    return {"rollout_corr/weight_mean": w / n, "rollout_corr/weight_max": float(peak[0]),
            f"rollout_corr/{name}": f / u, "rollout_corr/kl_k3": kl / n, "rollout_corr/ppl_ratio": math.exp(-d / n)}
