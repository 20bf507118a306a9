"""The policy loss: the DAPO token-level clipped loss (eq. 10-12) by default, or another registered variant.

    J = (1 / sum_i |o_i|) sum_i sum_t w_it min(r_it * A_i, clip(r_it, 1 - eps_low, 1 + eps_high) * A_i)
    r_it = pi_theta(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t)

The loss is -J. Its denominator is the token count of the whole global batch, passed in as
`global_num_tokens`, so that the per-micro-batch losses of all micro-batches and data-parallel
ranks sum (all-reduce SUM) to exactly the full-batch loss and gradient. w_it are optional constant
importance weights (rollout correction, algo/rollout_correction.py), 1 by default; they scale the
token terms and leave the denominator alone, so the split property holds with them too.

`kind` selects the variant's token terms (algo/policy_losses.py: dapo, gspo, cispo, dr_grpo or a user's
registered function); the masking, importance weights, global normalisers and metrics here are shared.

Options beyond the paper's eq. 10 (both off by default):
  - dual-clip (Ye et al. 2020, verl's `clip_ratio_c`): for A < 0 the objective is
    max(min(r A, clip(r) A), c A), i.e. the token loss is capped at -c A once r > c;
  - `is_weights`, the w_it above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import torch

from megatron_dapo.algo.loss_settings import AGG_MODES, LossSettings
from megatron_dapo.algo.policy_losses import LOG_RATIO_LIMIT, LossInputs, TokenTerms
from megatron_dapo.config.schema import LossAggMode as AggMode

Count: TypeAlias = int | float | torch.Tensor

__all__ = ["AGG_MODES", "LOG_RATIO_LIMIT", "AggMode", "Count", "PolicyLossMetrics", "aggregate",
           "check_tensors", "policy_loss", "settled_policy_loss"]


@dataclass
class PolicyLossMetrics:
    """Detached scalar tensors describing one `policy_loss` call.

    Fractions and means are over this call's valid (mask != 0) tokens, whatever their importance
    weight; to combine calls, weight each by its `num_tokens`. Ratios are the clamped ones (see
    LOG_RATIO_LIMIT) of the variant: GSPO's are each token's sequence ratio s_i, so its clip fractions
    count the tokens of clipped sequences; CISPO's clipfrac_high counts the tokens whose weight is capped.
    """

    clipfrac_high: torch.Tensor
    """Fraction of tokens whose upper clip is active: A > 0 and r > 1 + eps_high (zero gradient; CISPO:
    r > eps_high, its weight capped, the gradient kept)."""
    clipfrac_low: torch.Tensor
    """Fraction of tokens whose lower clip is active: A < 0 and r < 1 - eps_low (zero gradient; CISPO: 0)."""
    clipfrac_dual: torch.Tensor
    """Fraction of tokens whose dual clip is active: A < 0 and r > clip_ratio_c (zero gradient);
    0 when dual-clip is off."""
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
    eps_low: float | None = None,
    eps_high: float | None = None,
    agg_mode: AggMode = "token-mean",
    global_num_tokens: Count | None = None,
    *,
    global_num_seqs: Count | None = None,
    clip_ratio_c: float | None = None,
    is_weights: torch.Tensor | None = None,
    kind: str = "dapo",
    max_response_len: int | None = None,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """The policy-gradient loss of `kind` (to minimise); DAPO's clip-higher token-level loss by default.

    Args:
        logprobs: [B, T] log pi_theta of the sampled tokens (carries the gradient).
        old_logprobs: [B, T] log pi_old of the same tokens (treated as a constant).
        advantages: [B] (broadcast to every token of the row) or [B, T].
        mask: [B, T] of 0/1 (float or bool); 1 marks tokens that enter the loss. Values at masked positions of
            the other inputs are ignored, even if they are inf or nan.
        eps_low, eps_high: the decoupled clip range [1 - eps_low, 1 + eps_high] of the ratio (CISPO: eps_high
            caps its weight); None = the variant's default (dapo 0.2 / 0.28, gspo 3e-4 / 4e-4, cispo - / 5,
            dr_grpo 0.2 / 0.2).
        agg_mode: "token-mean" (DAPO): token sum / global_num_tokens.
            "seq-mean-token-mean" (GRPO): sum over rows of (the row's token sum / its valid-token
            count), / global_num_seqs. "seq-mean-token-sum": sum over rows of the row's token sum,
            / global_num_seqs. Not used by dr_grpo (see max_response_len).
        global_num_tokens: valid-token count of the whole global batch (token-mean only);
            default: this call's mask count.
        global_num_seqs: number of rows with >= 1 valid token in the whole global batch (seq
            modes and dr_grpo); default: this call's count.
        clip_ratio_c: dual-clip bound c > 1: for A < 0 the token loss is capped at -c A (zero gradient
            beyond it). None (default) is the paper's eq. 10. Refused by variants without a dual clip (cispo).
        is_weights: [B, T] constant per-token weights (detached here) multiplying the token loss terms;
            the normalisers above stay valid-token / valid-row counts.
        kind: the variant (algo/policy_losses.py): dapo, gspo, cispo, dr_grpo or `module.path:function`.
        max_response_len: dr_grpo's L_max: its loss is the token sum / (global_num_seqs x max_response_len).

    A zero denominator (nothing valid anywhere) gives a loss of 0, not nan. The log-ratio is clamped
    to +-LOG_RATIO_LIMIT (see there); callers feed fp32 log-probabilities.

    Returns:
        (loss, metrics): a scalar loss and detached `PolicyLossMetrics`.
    """
    settings = LossSettings.resolve(kind, eps_low, eps_high, agg_mode, clip_ratio_c, max_response_len)
    return settled_policy_loss(settings, logprobs, old_logprobs, advantages, mask, global_num_tokens,
                               global_num_seqs, is_weights)


def settled_policy_loss(
    settings: LossSettings,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """policy_loss with its settings resolved once (LossSettings): what the kernels and the actor call."""
    check_tensors(logprobs, old_logprobs, advantages, mask, is_weights)
    spec = settings.spec
    valid = mask != 0
    weight = mask.to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.to(logprobs.dtype).expand_as(logprobs)
    # where() keeps garbage at padded positions (e.g. -inf logprobs) out of exp() and its gradient.
    advantages = torch.where(valid, advantages, torch.zeros_like(advantages))
    inputs = LossInputs(logprobs, old_logprobs.detach(), advantages, valid, settings.eps_low, settings.eps_high,
                        settings.clip_ratio_c)
    terms = spec.fn(inputs)
    token_loss = terms.loss * _token_weights(weight, valid, is_weights)

    loss = aggregate(token_loss, weight, valid, settings.agg_mode, global_num_tokens, global_num_seqs,
                     normaliser=spec.normaliser, max_response_len=settings.max_response_len)
    return loss, _metrics(terms, valid)


def _token_weights(
    weight: torch.Tensor, valid: torch.Tensor, is_weights: torch.Tensor | None
) -> torch.Tensor:
    """mask * is_weights (detached, zero where the mask is) in the mask's dtype."""
    if is_weights is None:
        return weight
    return weight * torch.where(valid, is_weights.detach().to(weight.dtype), torch.zeros_like(weight))


def check_tensors(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    is_weights: torch.Tensor | None = None,
) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    named = (("old_logprobs", old_logprobs), ("mask", mask), ("is_weights", is_weights))
    for name, t in named:
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logprobs shape {tuple(logprobs.shape)}")
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(
            f"advantages must be [B] or [B, T] = {tuple(logprobs.shape)}, got {tuple(advantages.shape)}"
        )


def _as_denominator(count: Count | None, default: torch.Tensor) -> torch.Tensor:
    value = default if count is None else torch.as_tensor(count)
    return value.to(device=default.device, dtype=default.dtype).clamp(min=1)


def aggregate(
    token_loss: torch.Tensor,
    weight: torch.Tensor,
    valid: torch.Tensor,
    agg_mode: str,
    global_num_tokens: Count | None,
    global_num_seqs: Count | None,
    *,
    normaliser: str = "agg_mode",
    max_response_len: int | None = None,
) -> torch.Tensor:
    """[B, T] token losses (zero where invalid) -> the scalar loss of `agg_mode` (see policy_loss), or with
    normaliser="max_len" (Dr. GRPO) the token sum / (global_num_seqs x max_response_len).

    `weight` is the 0/1 mask in the loss dtype: its counts are the normalisers.
    """
    if normaliser == "max_len":
        num_seqs = valid.any(dim=-1).to(weight.dtype).sum()
        return token_loss.sum() / (_as_denominator(global_num_seqs, num_seqs) * float(max_response_len))
    if agg_mode == "token-mean":
        return token_loss.sum() / _as_denominator(global_num_tokens, weight.sum())
    seq_loss = token_loss.sum(dim=-1)
    if agg_mode == "seq-mean-token-mean":
        seq_loss = seq_loss / weight.sum(dim=-1).clamp(min=1)
    num_seqs = valid.any(dim=-1).to(weight.dtype).sum()
    return seq_loss.sum() / _as_denominator(global_num_seqs, num_seqs)


@torch.no_grad()
def _metrics(terms: TokenTerms, valid: torch.Tensor) -> PolicyLossMetrics:
    ratio = terms.ratio
    num_tokens = valid.sum().to(ratio.dtype)
    denom = num_tokens.clamp(min=1)

    def frac(flags: torch.Tensor) -> torch.Tensor:
        return (flags & valid).sum().to(ratio.dtype) / denom

    # Masked positions hold ratio 1 and log_ratio 0, so they add nothing to the sums below.
    k3 = (ratio - 1.0) - terms.log_ratio
    # ratio = exp(.) > 0, so 0 at masked positions never wins and an empty call reports 0.
    masked = torch.where(valid, ratio, torch.zeros_like(ratio))
    ratio_max = masked.max() if masked.numel() else ratio.new_zeros(())
    return PolicyLossMetrics(
        clipfrac_high=frac(terms.clip_high),
        clipfrac_low=frac(terms.clip_low),
        clipfrac_dual=frac(terms.clip_dual),
        ratio_mean=(ratio * valid).sum() / denom,
        ratio_max=ratio_max,
        approx_kl=(k3 * valid).sum() / denom,
        num_tokens=num_tokens,
    )
