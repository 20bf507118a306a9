"""The DAPO token-level clipped policy loss (eq. 10-12) and the GRPO-style aggregations it replaces.

    J = (1 / sum_i |o_i|) sum_i sum_t min(r_it * A_i, clip(r_it, 1 - eps_low, 1 + eps_high) * A_i)
    r_it = pi_theta(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t)

The loss is -J. Its denominator is the token count of the whole global batch, passed in as
`global_num_tokens`, so that the per-micro-batch losses of all micro-batches and data-parallel
ranks sum (all-reduce SUM) to exactly the full-batch loss and gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
AGG_MODES: tuple[str, ...] = get_args(AggMode)

Count = int | float | torch.Tensor


@dataclass
class PolicyLossMetrics:
    """Detached scalar tensors describing one `policy_loss` call.

    Fractions and means are over this call's valid (mask != 0) tokens; to combine calls,
    weight each by its `num_tokens`.
    """

    clipfrac_high: torch.Tensor
    """Fraction of tokens whose upper clip is active: A > 0 and r > 1 + eps_high (zero gradient)."""
    clipfrac_low: torch.Tensor
    """Fraction of tokens whose lower clip is active: A < 0 and r < 1 - eps_low (zero gradient)."""
    ratio_mean: torch.Tensor
    ratio_max: torch.Tensor
    approx_kl: torch.Tensor
    """k3 estimator of KL(pi_old || pi_theta): mean of (r - 1) - log r; >= 0 per token."""
    num_tokens: torch.Tensor


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    agg_mode: AggMode = "token-mean",
    global_num_tokens: Count | None = None,
    *,
    global_num_seqs: Count | None = None,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """Clip-higher, token-level policy-gradient loss (to minimise).

    Args:
        logprobs: [B, T] log pi_theta of the sampled tokens (carries the gradient).
        old_logprobs: [B, T] log pi_old of the same tokens (treated as a constant).
        advantages: [B] (broadcast to every token of the row) or [B, T].
        mask: [B, T] of 0/1 (float or bool); 1 marks tokens that enter the loss. Values at masked positions of
            the other inputs are ignored, even if they are inf or nan.
        eps_low, eps_high: the decoupled clip range [1 - eps_low, 1 + eps_high] of the ratio.
        agg_mode: "token-mean" (DAPO): token sum / global_num_tokens.
            "seq-mean-token-mean" (GRPO): sum over rows of the row's token mean / global_num_seqs.
            "seq-mean-token-sum": sum over rows of the row's token sum / global_num_seqs.
        global_num_tokens: valid-token count of the whole global batch (token-mean only);
            default: this call's mask count.
        global_num_seqs: number of rows with >= 1 valid token in the whole global batch (seq
            modes only); default: this call's count.

    A zero denominator (nothing valid anywhere) gives a loss of 0, not nan. The ratio is not
    clamped, so the loss is exact; callers feed fp32 log-probabilities.

    Returns:
        (loss, metrics): a scalar loss and detached `PolicyLossMetrics`.
    """
    validate_inputs(logprobs, old_logprobs, advantages, mask, eps_low, eps_high, agg_mode)
    valid = mask != 0
    weight = mask.to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.to(logprobs.dtype).expand_as(logprobs)

    # where() keeps garbage at padded positions (e.g. -inf logprobs) out of exp() and its gradient.
    log_ratio = torch.where(valid, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
    advantages = torch.where(valid, advantages, torch.zeros_like(advantages))
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    objective = torch.minimum(ratio * advantages, clipped * advantages)
    token_loss = -objective * weight

    loss = _aggregate(token_loss, weight, valid, agg_mode, global_num_tokens, global_num_seqs)
    metrics = _metrics(ratio.detach(), log_ratio.detach(), advantages, valid, eps_low, eps_high)
    return loss, metrics


def validate_inputs(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    agg_mode: str,
) -> None:
    if agg_mode not in AGG_MODES:
        raise ValueError(f"unknown agg_mode {agg_mode!r}; valid: {', '.join(AGG_MODES)}")
    if not 0.0 <= eps_low < 1.0:
        raise ValueError(f"eps_low must be in [0, 1), got {eps_low}")
    if eps_high < 0.0:
        raise ValueError(f"eps_high must be >= 0, got {eps_high}")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    for name, t in (("old_logprobs", old_logprobs), ("mask", mask)):
        if t.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logprobs shape {tuple(logprobs.shape)}")
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(
            f"advantages must be [B] or [B, T] = {tuple(logprobs.shape)}, got {tuple(advantages.shape)}"
        )


def _as_denominator(count: Count | None, default: torch.Tensor) -> torch.Tensor:
    value = default if count is None else torch.as_tensor(count)
    return value.to(device=default.device, dtype=default.dtype).clamp(min=1)


def _aggregate(
    token_loss: torch.Tensor,
    weight: torch.Tensor,
    valid: torch.Tensor,
    agg_mode: str,
    global_num_tokens: Count | None,
    global_num_seqs: Count | None,
) -> torch.Tensor:
    if agg_mode == "token-mean":
        return token_loss.sum() / _as_denominator(global_num_tokens, weight.sum())
    seq_loss = token_loss.sum(dim=-1)
    if agg_mode == "seq-mean-token-mean":
        seq_loss = seq_loss / weight.sum(dim=-1).clamp(min=1)
    num_seqs = valid.any(dim=-1).to(weight.dtype).sum()
    return seq_loss.sum() / _as_denominator(global_num_seqs, num_seqs)


@torch.no_grad()
def _metrics(
    ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> PolicyLossMetrics:
    num_tokens = valid.sum().to(ratio.dtype)
    denom = num_tokens.clamp(min=1)

    def frac(flags: torch.Tensor) -> torch.Tensor:
        return (flags & valid).sum().to(ratio.dtype) / denom

    # Masked positions hold ratio 1 and log_ratio 0, so they add nothing to the sums below.
    k3 = (ratio - 1.0) - log_ratio
    # ratio = exp(.) > 0, so 0 at masked positions never wins and an empty call reports 0.
    masked = torch.where(valid, ratio, torch.zeros_like(ratio))
    ratio_max = masked.max() if masked.numel() else ratio.new_zeros(())
    return PolicyLossMetrics(
        clipfrac_high=frac((advantages > 0) & (ratio > 1.0 + eps_high)),
        clipfrac_low=frac((advantages < 0) & (ratio < 1.0 - eps_low)),
        ratio_mean=(ratio * valid).sum() / denom,
        ratio_max=ratio_max,
        approx_kl=(k3 * valid).sum() / denom,
        num_tokens=num_tokens,
    )
