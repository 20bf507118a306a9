"""The policy loss for the actor: from logits, from hidden states, or from token logprobs.

`loss_from_logprobs` is the one "logprobs -> loss" entry: algo.loss.settled_policy_loss (one LossSettings: any
variant, agg_mode, dual-clip; importance weights) through the fused Triton clip kernel or plain torch, plus an
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

from megatron_dapo.algo.loss import Count, PolicyLossMetrics, aggregate, check_tensors, settled_policy_loss
from megatron_dapo.algo.loss_settings import LossSettings
from megatron_dapo.algo.policy_losses import PolicyLossSpec, policy_loss_spec, sequence_log_ratio
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
    settings: LossSettings | None = None,
    *,
    global_num_tokens: Count | None,
    global_num_seqs: Count | None = None,
    is_weights: torch.Tensor | None = None,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    impl: str = "auto",
    inplace_backward: bool = False,
    chunk_bytes: int | None = None,
    **loss_kw,
) -> tuple[torch.Tensor, FusedLossMetrics]:
    """loss_from_logprobs(*token_logprobs_and_entropy(logits, targets), ...): the DAPO loss from logits.

    Args:
        logits: [B, T, V_local] (vocab shard when `tp_group` has >1 ranks, see token_logprobs_and_entropy).
        targets: [B, T] global token ids; old_logprobs, mask: [B, T]; advantages: [B] or [B, T].
        settings (or its fields as keywords), global_num_tokens, global_num_seqs, is_weights: as in
        loss_from_logprobs.
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
    return loss_from_logprobs(logprobs, entropy, old_logprobs, advantages, mask, settings,
                              global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
                              is_weights=is_weights, impl=impl, **loss_kw)


def fused_linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings | None = None,
    *,
    global_num_tokens: Count | None,
    global_num_seqs: Count | None = None,
    is_weights: torch.Tensor | None = None,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    impl: str = "auto",
    chunk_bytes: int | None = None,
    **loss_kw,
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
    return loss_from_logprobs(logprobs, entropy, old_logprobs, advantages, mask, settings,
                              global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
                              is_weights=is_weights, impl=impl, **loss_kw)


def loss_from_logprobs(
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings | None = None,
    *,
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    is_weights: torch.Tensor | None = None,
    impl: str = "torch",
    **loss_kw,
) -> tuple[torch.Tensor, FusedLossMetrics]:
    """The policy loss to minimise from [B, T] token logprobs (and entropies):

        settled_policy_loss(settings, logprobs, old_logprobs, advantages, mask, global_num_tokens,
                            global_num_seqs, is_weights)
            - settings.entropy_coef * sum(mask * entropy) / global_num_tokens

    Args:
        settings: the loss's LossSettings (resolved once, at start-up). Without it, its fields as keywords
            (kind, eps_low, eps_high, agg_mode, clip_ratio_c, max_response_len, entropy_coef), resolved here.
        entropy: [B, T] token entropies, or None (then the metric is 0 and entropy_coef must be 0).
            With entropy_coef == 0 it is a detached monitor, so the kernels skip its backward.
        global_num_tokens: valid-token count of the global batch: the token-mean normaliser and, in
            every agg_mode, the entropy bonus's (None: this call's count).
        impl: "triton" runs the fused clip kernel for the variants it covers (see `loss_path`; the seq
            modes aggregate its token losses in torch), the others in torch; "torch" runs
            algo.loss.settled_policy_loss; "auto" as in kernels.resolve_impl.
        The rest: as in algo.loss.policy_loss.
    """
    impl = resolve_impl(impl, logprobs.device)
    if settings is None:
        settings = LossSettings.resolve(**loss_kw)
    elif loss_kw:
        raise TypeError(f"pass the loss settings as LossSettings or as keywords, not both: {sorted(loss_kw)}")
    coef = settings.entropy_coef
    if entropy is None and coef != 0.0:
        raise ValueError(f"entropy_coef={coef} needs token entropies, got entropy=None")
    in_kernel = impl == "triton" and settings.spec.ratio is not None
    loss_fn = _triton_policy_loss if in_kernel else settled_policy_loss
    loss, metrics = loss_fn(settings, logprobs, old_logprobs, advantages, mask, global_num_tokens, global_num_seqs,
                            is_weights)
    if entropy is None:
        mean_entropy = torch.zeros((), device=logprobs.device)
    else:
        bonus, mean_entropy = _entropy_bonus(entropy, mask != 0, coef, global_num_tokens)
        loss = loss - bonus if coef != 0.0 else loss
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
    settings: LossSettings,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    global_num_tokens: Count | None,
    global_num_seqs: Count | None,
    is_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    """settled_policy_loss through the fused clip kernel: same arguments, result and metrics (in fp32), for a
    variant whose spec has a `ratio` (the clipped surrogate of a token or sequence ratio)."""
    from megatron_dapo.kernels.policy_loss_triton import DUAL_CLIP_OFF, ClipLoss

    spec = settings.spec
    check_tensors(logprobs, old_logprobs, advantages, mask, is_weights)
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
    dual_c = DUAL_CLIP_OFF if settings.clip_ratio_c is None else float(settings.clip_ratio_c)
    token_loss, ratio, log_ratio, clip = ClipLoss.apply(*flat, settings.eps_low, settings.eps_high, dual_c)
    loss = aggregate(token_loss.view_as(weight), weight, valid, settings.agg_mode, global_num_tokens,
                     global_num_seqs, normaliser=spec.normaliser, max_response_len=settings.max_response_len)
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
