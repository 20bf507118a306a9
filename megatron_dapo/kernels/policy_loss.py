"""The policy loss for the actor: from logits, from hidden states, or from token logprobs.

`loss_from_logprobs` is the one "logprobs -> loss" entry: algo.loss.policy_loss (any variant `kind`,
agg_mode, dual-clip, importance weights) through the fused Triton clip kernel or plain torch, plus an
optional entropy bonus normalised by the global token count. `fused_policy_loss` / `fused_linear_policy_loss`
put the logprob/entropy kernel in front of it. Every normaliser is a global count, so micro-batch
and data-parallel splits still sum to the full-batch loss and gradient.

The clip kernel computes the clipped surrogate of a ratio: dapo and dr_grpo (token ratios) and gspo (each
token given its sequence's ratio, through old_logprobs shifted to log pi_theta - log s_i) run in it; cispo and
user losses run their torch token terms (`loss_path` says which, for the start-up summary). The logprob and
entropy kernels in front serve every variant.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from megatron_dapo.algo.loss import (
    AggMode,
    Count,
    PolicyLossMetrics,
    aggregate,
    policy_loss,
    validate_inputs,
)
from megatron_dapo.algo.policy_losses import PolicyLossSpec, clip_range, policy_loss_spec, sequence_log_ratio
from megatron_dapo.kernels.linear_logprobs import linear_logprobs_and_entropy
from megatron_dapo.kernels.logprobs import resolve_impl, token_logprobs_and_entropy


@dataclass
class FusedLossMetrics(PolicyLossMetrics):
    """PolicyLossMetrics plus the mean entropy (nats) over this call's valid tokens (0 without entropy)."""

    entropy: torch.Tensor


def fused_policy_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float | None,
    eps_high: float | None,
    global_num_tokens: Count | None,
    global_num_seqs: Count | None = None,
    agg_mode: AggMode = "token-mean",
    clip_ratio_c: float | None = None,
    is_weights: torch.Tensor | None = None,
    kind: str = "dapo",
    max_response_len: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    entropy_coef: float = 0.0,
    impl: str = "auto",
    inplace_backward: bool = False,
    chunk_bytes: int | None = None,
) -> tuple[torch.Tensor, FusedLossMetrics]:
    """loss_from_logprobs(*token_logprobs_and_entropy(logits, targets), ...): the DAPO loss from logits.

    Args:
        logits: [B, T, V_local] (vocab shard when `tp_group` has >1 ranks, see token_logprobs_and_entropy).
        targets: [B, T] global token ids; old_logprobs, mask: [B, T]; advantages: [B] or [B, T].
        global_num_tokens, global_num_seqs, agg_mode, clip_ratio_c, is_weights, kind, max_response_len,
        entropy_coef: as in loss_from_logprobs.
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
    return loss_from_logprobs(
        logprobs, entropy, old_logprobs, advantages, mask,
        eps_low=eps_low, eps_high=eps_high, agg_mode=agg_mode, global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs, entropy_coef=entropy_coef, clip_ratio_c=clip_ratio_c,
        is_weights=is_weights, kind=kind, max_response_len=max_response_len, impl=impl,
    )  # fmt: skip


def fused_linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float | None,
    eps_high: float | None,
    global_num_tokens: Count | None,
    global_num_seqs: Count | None = None,
    agg_mode: AggMode = "token-mean",
    clip_ratio_c: float | None = None,
    is_weights: torch.Tensor | None = None,
    kind: str = "dapo",
    max_response_len: int | None = None,
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
    return loss_from_logprobs(
        logprobs, entropy, old_logprobs, advantages, mask,
        eps_low=eps_low, eps_high=eps_high, agg_mode=agg_mode, global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs, entropy_coef=entropy_coef, clip_ratio_c=clip_ratio_c,
        is_weights=is_weights, kind=kind, max_response_len=max_response_len, impl=impl,
    )  # fmt: skip


def loss_from_logprobs(
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float | None,
    eps_high: float | None,
    agg_mode: AggMode = "token-mean",
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    entropy_coef: float = 0.0,
    clip_ratio_c: float | None = None,
    is_weights: torch.Tensor | None = None,
    kind: str = "dapo",
    max_response_len: int | None = None,
    impl: str = "torch",
) -> tuple[torch.Tensor, FusedLossMetrics]:
    """The policy loss to minimise from [B, T] token logprobs (and entropies):

        policy_loss(logprobs, old_logprobs, advantages, mask, eps_low, eps_high, agg_mode,
                    global_num_tokens, global_num_seqs=..., clip_ratio_c=..., is_weights=..., kind=...,
                    max_response_len=...)
            - entropy_coef * sum(mask * entropy) / global_num_tokens

    Args:
        entropy: [B, T] token entropies, or None (then the metric is 0 and entropy_coef must be 0).
            With entropy_coef == 0 it is a detached monitor, so the kernels skip its backward.
        global_num_tokens: valid-token count of the global batch: the token-mean normaliser and, in
            every agg_mode, the entropy bonus's (None: this call's count).
        impl: "triton" runs the fused clip kernel for the variants it covers (see `loss_path`; the seq
            modes aggregate its token losses in torch), the others in torch; "torch" runs
            algo.loss.policy_loss; "auto" as in kernels.resolve_impl.
        The rest: as in algo.loss.policy_loss.
    """
    impl = resolve_impl(impl, logprobs.device)
    if entropy is None and entropy_coef != 0.0:
        raise ValueError(f"entropy_coef={entropy_coef} needs token entropies, got entropy=None")
    in_kernel = impl == "triton" and policy_loss_spec(kind).ratio is not None
    loss_fn = _triton_policy_loss if in_kernel else policy_loss
    loss, metrics = loss_fn(
        logprobs, old_logprobs, advantages, mask, eps_low, eps_high, agg_mode, global_num_tokens,
        global_num_seqs=global_num_seqs, clip_ratio_c=clip_ratio_c, is_weights=is_weights, kind=kind,
        max_response_len=max_response_len,
    )  # fmt: skip
    if entropy is None:
        mean_entropy = torch.zeros((), device=logprobs.device)
    else:
        bonus, mean_entropy = _entropy_bonus(entropy, mask != 0, entropy_coef, global_num_tokens)
        loss = loss - bonus if entropy_coef != 0.0 else loss
    return loss, FusedLossMetrics(
        **{f.name: getattr(metrics, f.name) for f in fields(metrics)}, entropy=mean_entropy
    )


def _entropy_bonus(
    entropy: torch.Tensor, valid: torch.Tensor, entropy_coef: float, global_num_tokens: Count | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(entropy_coef * sum(valid * entropy) / global_num_tokens, detached mean entropy over valid tokens)."""
    if entropy_coef == 0.0:
        entropy = entropy.detach()  # a monitor: no gradient reaches it, so the kernels skip its backward
    entropy_sum = torch.where(valid, entropy, 0.0).sum()
    bonus = entropy_coef * entropy_sum / _denominator(global_num_tokens, valid)
    return bonus, entropy_sum.detach() / valid.sum().clamp(min=1)


def _denominator(count: Count | None, valid: torch.Tensor) -> torch.Tensor:
    value = valid.sum() if count is None else torch.as_tensor(count)
    return value.to(device=valid.device, dtype=torch.float32).clamp(min=1)


def _triton_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float | None,
    eps_high: float | None,
    agg_mode: AggMode,
    global_num_tokens: Count | None,
    *,
    global_num_seqs: Count | None,
    clip_ratio_c: float | None,
    is_weights: torch.Tensor | None,
    kind: str,
    max_response_len: int | None,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """policy_loss through the fused clip kernel: same arguments, result and metrics (in fp32), for a
    variant whose spec has a `ratio` (the clipped surrogate of a token or sequence ratio)."""
    from megatron_dapo.kernels.policy_loss_triton import DUAL_CLIP_OFF, ClipLoss

    spec = policy_loss_spec(kind)
    eps_low, eps_high = clip_range(spec, eps_low, eps_high)
    validate_inputs(logprobs, old_logprobs, advantages, mask, eps_low, eps_high, agg_mode,
                    clip_ratio_c=clip_ratio_c, is_weights=is_weights, spec=spec,
                    max_response_len=max_response_len)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    f32 = {"dtype": torch.float32, "device": logprobs.device}
    weight = mask.detach().to(**f32)
    valid = mask != 0
    isw = torch.ones_like(weight) if is_weights is None else is_weights.detach().to(**f32)
    flat = [
        _kernel_old_logprobs(spec, logprobs.float(), old_logprobs.detach().to(**f32), valid),
        advantages.detach().to(**f32).expand_as(logprobs),
        weight,
        isw,
    ]
    flat = [t.reshape(-1).contiguous() for t in (logprobs.float(), *flat)]
    dual_c = DUAL_CLIP_OFF if clip_ratio_c is None else float(clip_ratio_c)
    token_loss, ratio, log_ratio, clip = ClipLoss.apply(*flat, eps_low, eps_high, dual_c)
    loss = aggregate(token_loss.view_as(weight), weight, valid, agg_mode, global_num_tokens, global_num_seqs,
                     normaliser=spec.normaliser, max_response_len=max_response_len)
    return loss, _clip_metrics(ratio, log_ratio, clip, valid.reshape(-1))


def _kernel_old_logprobs(spec: PolicyLossSpec, logprobs: torch.Tensor, old: torch.Tensor, valid: torch.Tensor
                         ) -> torch.Tensor:
    """What the kernel subtracts from log pi_theta: log pi_old for a token ratio; for a sequence ratio
    log pi_theta - log s_i (detached), so the kernel's ratio is s_i and its gradient s_i's GSPO-token one."""
    if spec.ratio == "token":
        return old
    lp = logprobs.detach()
    return torch.where(valid, lp - sequence_log_ratio(lp, old, valid), old)


def loss_path(kind: str, impl: str) -> str:
    """How `kind` is computed with `impl` (after resolve_impl): the line the start-up summary prints."""
    spec = policy_loss_spec(kind)
    if impl != "triton":
        return "torch"
    if spec.ratio is None:
        return "torch token terms (the Triton clip kernel does not cover this loss)"
    return f"fused Triton clip kernel ({spec.ratio} ratio)"


@torch.no_grad()
def _clip_metrics(
    ratio: torch.Tensor, log_ratio: torch.Tensor, clip: torch.Tensor, valid: torch.Tensor
) -> PolicyLossMetrics:
    num_tokens = valid.sum().float()
    denom = num_tokens.clamp(min=1)
    return PolicyLossMetrics(
        clipfrac_high=(clip == 1).sum().float() / denom,
        clipfrac_low=(clip == -1).sum().float() / denom,
        clipfrac_dual=(clip == 2).sum().float() / denom,
        ratio_mean=(ratio * valid).sum() / denom,
        ratio_max=torch.where(valid, ratio, 0.0).max() if ratio.numel() else ratio.new_zeros(()),
        approx_kl=(((ratio - 1.0) - log_ratio) * valid).sum() / denom,
        num_tokens=num_tokens,
    )
