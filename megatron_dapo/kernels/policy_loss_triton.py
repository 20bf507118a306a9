"""Triton kernel for the DAPO clipped token loss on [N] log-probabilities, with its autograd Function.

Per token (as algo.loss.policy_loss, masked positions neutralised before exp):
    r = exp(lp - old),  loss = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) * mask
    dloss/dlp = -A r mask where the unclipped branch is selected (r A <= clip(r) A), else 0
The kernel also emits the ratio, log-ratio and clip flags (+1 high, -1 low) for the metrics.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _clip_loss_kernel(
    lp_ptr, old_ptr, adv_ptr, mask_ptr,
    loss_ptr, dlp_ptr, ratio_ptr, log_ratio_ptr, clip_ptr,
    n, eps_low, eps_high,
    BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    w = tl.load(mask_ptr + offs, mask=inb, other=0.0)
    valid = w != 0
    lp = tl.load(lp_ptr + offs, mask=inb, other=0.0)
    old = tl.load(old_ptr + offs, mask=inb, other=0.0)
    log_ratio = tl.where(valid, lp - old, 0.0)
    a = tl.where(valid, tl.load(adv_ptr + offs, mask=inb, other=0.0), 0.0)
    r = tl.exp(log_ratio)
    c = tl.minimum(tl.maximum(r, 1.0 - eps_low), 1.0 + eps_high)
    unclipped = r * a
    clipped = c * a
    tl.store(loss_ptr + offs, -tl.minimum(unclipped, clipped) * w, mask=inb)
    tl.store(dlp_ptr + offs, tl.where(unclipped <= clipped, -(w * a) * r, 0.0), mask=inb)
    tl.store(ratio_ptr + offs, r, mask=inb)
    tl.store(log_ratio_ptr + offs, log_ratio, mask=inb)
    high = valid & (a > 0) & (r > 1.0 + eps_high)
    low = valid & (a < 0) & (r < 1.0 - eps_low)
    tl.store(clip_ptr + offs, tl.where(high, 1, tl.where(low, -1, 0)).to(tl.int8), mask=inb)


class ClipLoss(torch.autograd.Function):
    """[N] fp32 logprobs -> [N] token losses; also returns detached (ratio, log_ratio, clip flags)."""

    @staticmethod
    def forward(
        ctx: Any,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        weight: torch.Tensor,
        eps_low: float,
        eps_high: float,
    ) -> tuple[torch.Tensor, ...]:
        n = logprobs.numel()
        token_loss, dlp, ratio, log_ratio = (torch.empty_like(logprobs) for _ in range(4))
        clip = torch.empty(n, dtype=torch.int8, device=logprobs.device)
        if n:
            _clip_loss_kernel[(triton.cdiv(n, BLOCK),)](
                logprobs, old_logprobs, advantages, weight,
                token_loss, dlp, ratio, log_ratio, clip,
                n, eps_low, eps_high, BLOCK=BLOCK,
            )  # fmt: skip
        ctx.save_for_backward(dlp)
        ctx.mark_non_differentiable(ratio, log_ratio, clip)
        return token_loss, ratio, log_ratio, clip

    @staticmethod
    def backward(ctx: Any, g_loss: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        (dlp,) = ctx.saved_tensors
        return (g_loss * dlp,) + (None,) * 5
