"""The DAPO token-level clipped loss straight from logits: logprob/entropy kernel + clip on top.

Equals algo.loss.policy_loss(agg_mode="token-mean") applied to the exact token logprobs, with an
optional entropy bonus normalised by the same global token count, so micro-batch and data-parallel
splits still sum to the full-batch loss and gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from megatron_dapo.algo.loss import Count, PolicyLossMetrics, policy_loss, validate_inputs
from megatron_dapo.kernels.linear_logprobs import linear_logprobs_and_entropy
from megatron_dapo.kernels.logprobs import resolve_impl, token_logprobs_and_entropy


@dataclass
class FusedLossMetrics(PolicyLossMetrics):
    """PolicyLossMetrics plus the mean entropy (nats) over this call's valid tokens."""

    entropy: torch.Tensor


def fused_policy_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    global_num_tokens: Count | None,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    entropy_coef: float = 0.0,
    impl: str = "auto",
    inplace_backward: bool = False,
    chunk_bytes: int | None = None,
) -> tuple[torch.Tensor, FusedLossMetrics]:
    """The DAPO loss to minimise, from logits:

        policy_loss(logprobs, ..., "token-mean", global_num_tokens)
            - entropy_coef * sum(mask * entropy) / global_num_tokens

    Args:
        logits: [B, T, V_local] (vocab shard when `tp_group` has >1 ranks, see token_logprobs_and_entropy).
        targets: [B, T] global token ids; old_logprobs, mask: [B, T]; advantages: [B] or [B, T].
        global_num_tokens: valid-token count of the whole global batch (None: this call's count).
        entropy_coef: 0 keeps the entropy a monitor only (its backward is skipped).
        impl, inplace_backward, chunk_bytes: as in token_logprobs_and_entropy.
    """
    impl = resolve_impl(impl, logits.device)
    logprobs, entropy = token_logprobs_and_entropy(
        logits,
        targets,
        tp_group=tp_group,
        vocab_start=vocab_start,
        impl=impl,
        inplace_backward=inplace_backward,
        chunk_bytes=chunk_bytes,
    )
    return dapo_loss_from_logprobs(
        logprobs,
        entropy,
        old_logprobs,
        advantages,
        mask,
        eps_low,
        eps_high,
        global_num_tokens,
        entropy_coef,
        impl,
    )


def fused_linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    global_num_tokens: Count | None,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    entropy_coef: float = 0.0,
    impl: str = "auto",
    chunk_bytes: int | None = None,
) -> tuple[torch.Tensor, FusedLossMetrics]:
    """fused_policy_loss(hidden @ weight^T, ...) without the [B, T, V] logits (see linear_logprobs.py).

    hidden: [B, T, H] replicated over `tp_group`; weight: this rank's lm-head shard [V_local, H].
    """
    impl = resolve_impl(impl, hidden.device)
    logprobs, entropy = linear_logprobs_and_entropy(
        hidden,
        weight,
        targets,
        tp_group=tp_group,
        vocab_start=vocab_start,
        impl=impl,
        chunk_bytes=chunk_bytes,
    )
    return dapo_loss_from_logprobs(
        logprobs,
        entropy,
        old_logprobs,
        advantages,
        mask,
        eps_low,
        eps_high,
        global_num_tokens,
        entropy_coef,
        impl,
    )


def dapo_loss_from_logprobs(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    global_num_tokens: Count | None,
    entropy_coef: float,
    impl: str,
) -> tuple[torch.Tensor, FusedLossMetrics]:
    """The token-mean clipped loss (fused clip kernel for impl="triton") minus the entropy bonus."""
    if impl == "triton":
        loss, metrics = _triton_policy_loss(
            logprobs, old_logprobs, advantages, mask, eps_low, eps_high, global_num_tokens
        )
    else:
        loss, metrics = policy_loss(
            logprobs, old_logprobs, advantages, mask, eps_low, eps_high, "token-mean", global_num_tokens
        )
    valid = mask != 0
    if entropy_coef == 0.0:
        entropy = entropy.detach()  # a monitor: no gradient reaches it, so the kernels skip its backward
    entropy_sum = torch.where(valid, entropy, 0.0).sum()
    if entropy_coef != 0.0:
        loss = loss - entropy_coef * entropy_sum / _denominator(global_num_tokens, valid)
    mean_entropy = entropy_sum.detach() / metrics.num_tokens.clamp(min=1)
    return loss, FusedLossMetrics(
        **{f.name: getattr(metrics, f.name) for f in fields(metrics)}, entropy=mean_entropy
    )


def _denominator(count: Count | None, valid: torch.Tensor) -> torch.Tensor:
    value = valid.sum() if count is None else torch.as_tensor(count)
    return value.to(device=valid.device, dtype=torch.float32).clamp(min=1)


def _triton_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    global_num_tokens: Count | None,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """The token-mean loss through the fused clip kernel; same inputs, result and metrics as policy_loss."""
    from megatron_dapo.kernels.policy_loss_triton import ClipLoss

    validate_inputs(logprobs, old_logprobs, advantages, mask, eps_low, eps_high, "token-mean")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    f32 = {"dtype": torch.float32, "device": logprobs.device}
    flat = [
        old_logprobs.detach().to(**f32).reshape(-1).contiguous(),
        advantages.detach().to(**f32).expand_as(logprobs).reshape(-1).contiguous(),
        mask.detach().to(**f32).reshape(-1).contiguous(),
    ]
    token_loss, ratio, log_ratio, clip = ClipLoss.apply(logprobs.reshape(-1), *flat, eps_low, eps_high)
    valid = flat[2] != 0
    loss = token_loss.sum() / _denominator(global_num_tokens, valid)
    return loss, _clip_metrics(ratio, log_ratio, clip, valid)


@torch.no_grad()
def _clip_metrics(
    ratio: torch.Tensor, log_ratio: torch.Tensor, clip: torch.Tensor, valid: torch.Tensor
) -> PolicyLossMetrics:
    num_tokens = valid.sum().float()
    denom = num_tokens.clamp(min=1)
    return PolicyLossMetrics(
        clipfrac_high=(clip == 1).sum().float() / denom,
        clipfrac_low=(clip == -1).sum().float() / denom,
        ratio_mean=(ratio * valid).sum() / denom,
        ratio_max=torch.where(valid, ratio, 0.0).max(),
        approx_kl=(((ratio - 1.0) - log_ratio) * valid).sum() / denom,
        num_tokens=num_tokens,
    )
