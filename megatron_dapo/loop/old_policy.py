"""pi_old for the step's batch, and the rollout-correction weights that compare it with pi_rollout.

`algo.old_logprob_source`: "recompute" runs the actor's forward pass over the batch (the exact pi_old
of the trainer); "rollout" takes the engine's logprobs as pi_old and skips that pass (then the
train-inference mismatch goes uncorrected and unmeasured); "auto" is resolved once at start-up by
`resolve_old_logprob_source`. `algo.rollout_correction` multiplies each token's loss term by TIS / MIS
weights of pi_old / pi_rollout (algo/rollout_correction.py).

The rule for auto: the rollout's logprobs serve as pi_old only when the engine computes the actor's own
function: the embedded engine built on the actor's parameters (one process, CPU: every tensor but the
fused QKV is the actor's own memory, and the sync copies that one after each update), in float32, every
token sampled by the current weights (no partial rollout), and no rollout correction (which needs the
two to differ). Those logprobs are then pi_old up to float rounding:
the engine runs transformers' kernels (a KV-cached decode), the actor Megatron's (one forward per
sequence), so they differ in the last bits (about 2e-7 per token in the tiny run), where a recompute
makes the first update's ratio exactly 1. Equal up to rounding, not bit for bit: auto is not the default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from megatron_dapo import parallel
from megatron_dapo.actor.actor import Actor
from megatron_dapo.algo.rollout_correction import correction_spec, correction_weights
from megatron_dapo.config import AlgoConfig, RolloutConfig
from megatron_dapo.types import TrainBatch


@dataclass(frozen=True)
class OldLogprobSource:
    """How the run gets pi_old (algo.old_logprob_source, resolved) and why."""

    source: Literal["recompute", "rollout"]
    reason: str

    def line(self) -> str:
        """The start-up summary's line."""
        how = "recomputed by the actor" if self.source == "recompute" \
            else "the rollout's logprobs, no recompute pass"
        return f"{how} ({self.reason})"


def resolve_old_logprob_source(algo: AlgoConfig, rollout: RolloutConfig, correction: str, *,
                               engine_on_actor_weights: bool, dtype: torch.dtype,
                               routing_replay: str = "none") -> OldLogprobSource:
    """algo.old_logprob_source, auto decided by the rule of the module docstring. `correction`: the rollout
    correction in force (Config.rollout_correction); `engine_on_actor_weights`: the embedded engine was built
    on the actor's parameters (shared_weights.py); `dtype`: the model's; `routing_replay`: actor.routing_replay
    (r2 replays the routes the recompute pass records: it needs that pass)."""
    setting = f"algo.old_logprob_source={algo.old_logprob_source}"
    if algo.old_logprob_source == "recompute":
        return OldLogprobSource("recompute", setting)
    if routing_replay == "r2":
        if algo.old_logprob_source == "rollout":
            raise ValueError("actor.routing_replay=r2 replays the routes of pi_old's recompute pass: it needs "
                             "algo.old_logprob_source=recompute (or auto)")
        return OldLogprobSource("recompute", f"{setting}: actor.routing_replay=r2 records the routes in that pass")
    if algo.old_logprob_source == "rollout":
        return OldLogprobSource("rollout", f"{setting}: the train-inference mismatch enters the ratio unmeasured")
    why_not = []
    if correction != "none":
        why_not.append(f"algo.rollout_correction={correction} weighs pi_old against the "
                       "rollout's logprobs")
    if rollout.partial_rollout:
        why_not.append("rollout.partial_rollout: a continued response's earlier tokens were sampled by "
                       "older weights")
    if rollout.engine != "embedded":
        why_not.append(f"rollout.engine={rollout.engine} computes with its own kernels and weights")
    elif dtype != torch.float32:
        why_not.append(f"model dtype {str(dtype).removeprefix('torch.')}: the engine's and the actor's "
                       "kernels round differently far above float32 rounding")
    elif not engine_on_actor_weights:
        why_not.append("the embedded engine holds its own copy of the weights; it shares the actor's in one "
                       "process on CPU with actor.offload_when_idle=false")
    if why_not:
        return OldLogprobSource("recompute", f"{setting}: " + "; ".join(why_not))
    return OldLogprobSource("rollout", f"{setting}: the embedded engine samples from the actor's own float32 "
                                       "weights, its logprobs are pi_old up to float rounding")


def old_logprobs(actor: Actor, batch: TrainBatch,
                 source: OldLogprobSource) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log pi_old [B, S], token entropies [B, S] or None when no forward pass ran), at the generated tokens
    (the prompt's read 0: the loss, the correction and the monitors read responses only)."""
    if source.source == "rollout":
        return batch.rollout_logprobs.clone(), None
    return actor.compute_logprobs(batch, responses_only=True, record_routes=actor.routes is not None)


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
