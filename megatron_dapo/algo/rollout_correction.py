"""Rollout correction: importance weights for the train-inference mismatch (TIS / MIS).

The rollout engine samples from pi_rollout, which is not exactly the trainer's pi_old (other kernels,
bf16), so the "on-policy" batch is slightly off-policy. With the per-token log ratio

    d_t = log pi_old(o_t) - log pi_rollout(o_t)        (train over rollout)

the correction weights w multiply the policy-loss token terms (algo.loss.policy_loss(is_weights=w)):

    truncate (TIS): token    w_t = min(exp(d_t), C)
                    sequence w_t = min(exp(sum_s d_s), C) for every token of the row
    mask (MIS):     token    w_t = 1 if C_low <= exp(d_t) <= C else 0
                    sequence w_t = 1 if C_low <= exp(sum_s d_s) <= C else 0 (the whole row)

C = `threshold`, C_low = `threshold_low` (default 1 / C: a band symmetric in log space). Everything
is computed in log space (d <= log C), so no exp overflows. Weights are constants (no gradient) and
0 wherever the mask is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

Level = Literal["token", "sequence"]
Mode = Literal["truncate", "mask"]

CORRECTIONS: dict[str, tuple[Level, Mode]] = {
    "token_tis": ("token", "truncate"),
    "seq_tis": ("sequence", "truncate"),
    "token_mis": ("token", "mask"),
    "seq_mis": ("sequence", "mask"),
}
"""AlgoConfig.rollout_correction names (besides "none") -> (level, mode) of `correction_weights`."""


def correction_spec(name: str) -> tuple[Level, Mode] | None:
    """(level, mode) for a config name; None for "none"; ValueError for anything else."""
    if name == "none":
        return None
    if name not in CORRECTIONS:
        raise ValueError(f"unknown rollout correction {name!r}; valid: none, {', '.join(CORRECTIONS)}")
    return CORRECTIONS[name]


@dataclass(frozen=True)
class CorrectionMetrics:
    """What one `correction_weights` call did (plain floats; where nothing is valid all are 0.0 but
    ppl_ratio, 1.0).

    Token means are over valid tokens; combine calls by weighting with `num_tokens` (the fractions
    at sequence level with `num_seqs`), maxima by max.
    """

    weight_mean: float
    """Mean weight over valid tokens."""
    weight_max: float
    """Largest weight over valid tokens."""
    clipped_frac: float | None
    """truncate: fraction of units (valid tokens, or rows with >= 1 valid token at sequence level)
    whose ratio exceeded C and was truncated; None in mask mode."""
    masked_frac: float | None
    """mask: fraction of units (as clipped_frac) dropped, ratio outside [C_low, C]; None in truncate mode."""
    kl_k3: float
    """k3 estimate of KL(pi_rollout || pi_old): mean over valid tokens of exp(d) - 1 - d. The tokens are
    sampled from pi_rollout and exp(d) = pi_old / pi_rollout, so E[exp(d) - 1] = 0 and E[-d] is that KL."""
    ppl_ratio: float
    """Perplexity of the trainer over that of the engine on these tokens:
    exp(-mean(old)) / exp(-mean(rollout)) = exp(-mean(d)), means over valid tokens; > 1: the trainer
    finds the samples less likely than the engine did."""
    num_tokens: int
    num_seqs: int


@torch.no_grad()
def correction_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: Level = "token",
    mode: Mode = "truncate",
    threshold: float = 2.0,
    threshold_low: float | None = None,
) -> tuple[torch.Tensor, CorrectionMetrics]:
    """Importance weights [B, T] (dtype of old_logprobs, detached) and their metrics; see the module doc.

    Args:
        old_logprobs, rollout_logprobs: [B, T] log pi_old and log pi_rollout of the sampled tokens.
        mask: [B, T] 0/1; values of the log-probs at masked positions are ignored.
        level: "token" (a ratio per token) or "sequence" (one ratio per row: the product of its
            token ratios, i.e. the sum of the log ratios).
        mode: "truncate" (TIS: min(ratio, threshold)) or "mask" (MIS: 0/1 by the band).
        threshold: C > 0, the truncation bound or the band's upper end.
        threshold_low: the band's lower end in mask mode (default 1 / threshold), 0 < C_low < C;
            truncate mode ignores it.
    """
    low = _check(old_logprobs, rollout_logprobs, mask, level, mode, threshold, threshold_low)
    valid = mask != 0
    d = torch.where(valid, old_logprobs.double() - rollout_logprobs.double(), 0.0)
    log_ratio = d.sum(dim=-1, keepdim=True).expand_as(d) if level == "sequence" else d
    log_c = math.log(threshold)
    if mode == "truncate":
        out = log_ratio > log_c
        weights = torch.exp(log_ratio.clamp(max=log_c))
    else:
        out = (log_ratio < math.log(low)) | (log_ratio > log_c)
        weights = (~out).double()
    weights = torch.where(valid, weights, 0.0)
    metrics = _metrics(d, weights, out, valid, level, mode)
    return weights.to(old_logprobs.dtype), metrics


def _check(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, level: str, mode: str,
    threshold: float, threshold_low: float | None,
) -> float:  # fmt: skip
    """Validate the arguments; return the resolved lower band end."""
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    if mode not in ("truncate", "mask"):
        raise ValueError(f"mode must be 'truncate' or 'mask', got {mode!r}")
    if old.dim() != 2 or rollout.shape != old.shape or mask.shape != old.shape:
        raise ValueError(
            f"old_logprobs, rollout_logprobs and mask must share one [B, T] shape, got "
            f"{tuple(old.shape)}, {tuple(rollout.shape)}, {tuple(mask.shape)}"
        )
    if not threshold > 0:
        raise ValueError(f"threshold must be > 0, got {threshold}")
    low = 1.0 / threshold if threshold_low is None else threshold_low
    if mode == "mask" and not 0 < low < threshold:
        raise ValueError(f"need 0 < threshold_low < threshold, got {low} and {threshold}")
    return low


def _metrics(
    d: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, valid: torch.Tensor, level: str, mode: str
) -> CorrectionMetrics:
    num_tokens = int(valid.sum())
    rows = valid.any(dim=-1)
    num_seqs = int(rows.sum())
    tokens = max(num_tokens, 1)
    if level == "sequence":
        frac = float((out.any(dim=-1) & rows).sum()) / max(num_seqs, 1)  # a row's positions share one flag
    else:
        frac = float((out & valid).sum()) / tokens
    k3 = torch.where(valid, torch.expm1(d) - d, 0.0)
    return CorrectionMetrics(
        weight_mean=float(weights.sum()) / tokens,
        weight_max=float(weights.max()) if num_tokens else 0.0,
        clipped_frac=frac if mode == "truncate" else None,
        masked_frac=frac if mode == "mask" else None,
        kl_k3=float(k3.sum()) / tokens,
        ppl_ratio=math.exp(-float(d.sum()) / tokens),
        num_tokens=num_tokens,
        num_seqs=num_seqs,
    )
