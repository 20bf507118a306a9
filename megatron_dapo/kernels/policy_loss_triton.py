"""Triton kernel for the DAPO clipped token loss on [N] log-probabilities, with its autograd Function.

Per token (as algo.loss.policy_loss, masked positions neutralised before exp, L = LOG_RATIO_LIMIT):
    r = exp(clamp(lp - old, -L, L)),  obj = min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
    obj = c A where A < 0 and r > c (dual-clip; c = DUAL_CLIP_OFF when off)
    loss = -obj * mask * w                            (w: constant importance weight)
    dloss/dlp = -A r mask w where the unclipped branch is selected (r A <= clip(r) A), |lp - old| <= L
                and the dual clip is inactive; else 0
The kernel also emits the ratio, log-ratio and clip flags (+1 high, -1 low, 2 dual) for the metrics.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from megatron_dapo.algo.loss import LOG_RATIO_LIMIT

BLOCK = 1024
_LIMIT = tl.constexpr(LOG_RATIO_LIMIT)
DUAL_CLIP_OFF = 2.0 * math.exp(LOG_RATIO_LIMIT)
"""A dual-clip bound no clamped ratio reaches (r <= e^L): dual-clip off, with c * A still finite."""


@triton.jit
def _clip_loss_kernel(
    lp_ptr, old_ptr, adv_ptr, mask_ptr, isw_ptr,
    loss_ptr, dlp_ptr, ratio_ptr, log_ratio_ptr, clip_ptr,
    n, eps_low, eps_high, clip_ratio_c,
    BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    w = tl.load(mask_ptr + offs, mask=inb, other=0.0)
    valid = w != 0
    lp = tl.load(lp_ptr + offs, mask=inb, other=0.0)
    old = tl.load(old_ptr + offs, mask=inb, other=0.0)
    raw = tl.where(valid, lp - old, 0.0)
    inside = (raw >= -_LIMIT) & (raw <= _LIMIT)
    log_ratio = tl.minimum(tl.maximum(raw, -_LIMIT), _LIMIT)
    a = tl.where(valid, tl.load(adv_ptr + offs, mask=inb, other=0.0), 0.0)
    tw = w * tl.where(valid, tl.load(isw_ptr + offs, mask=inb, other=0.0), 0.0)
    r = tl.exp(log_ratio)
    c = tl.minimum(tl.maximum(r, 1.0 - eps_low), 1.0 + eps_high)
    unclipped = r * a
    clipped = c * a
    dual = valid & (a < 0) & (r > clip_ratio_c)
    obj = tl.where(dual, clip_ratio_c * a, tl.minimum(unclipped, clipped))
    tl.store(loss_ptr + offs, -obj * tw, mask=inb)
    live = (unclipped <= clipped) & inside
    tl.store(dlp_ptr + offs, tl.where(dual, 0.0, tl.where(live, -(tw * a) * r, 0.0)), mask=inb)
    tl.store(ratio_ptr + offs, r, mask=inb)
    tl.store(log_ratio_ptr + offs, log_ratio, mask=inb)
    high = valid & (a > 0) & (r > 1.0 + eps_high)
    low = valid & (a < 0) & (r < 1.0 - eps_low)
    flag = tl.where(high, 1, tl.where(low, -1, tl.where(dual, 2, 0)))
    tl.store(clip_ptr + offs, flag.to(tl.int8), mask=inb)


class ClipLoss(torch.autograd.Function):
    """[N] fp32 logprobs -> [N] token losses; also returns detached (ratio, log_ratio, clip flags).

    `weight` is the 0/1 mask, `is_weights` the constant importance weights (ones for none), and
    `clip_ratio_c` the dual-clip bound (DUAL_CLIP_OFF for none); all inputs [N] contiguous fp32.
    """

    @staticmethod
    def forward(
        ctx: Any,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        weight: torch.Tensor,
        is_weights: torch.Tensor,
        eps_low: float,
        eps_high: float,
        clip_ratio_c: float,
    ) -> tuple[torch.Tensor, ...]:
        n = logprobs.numel()
        token_loss, dlp, ratio, log_ratio = (torch.empty_like(logprobs) for _ in range(4))
        clip = torch.empty(n, dtype=torch.int8, device=logprobs.device)
        if n:
            _clip_loss_kernel[(triton.cdiv(n, BLOCK),)](
                logprobs, old_logprobs, advantages, weight, is_weights,
                token_loss, dlp, ratio, log_ratio, clip,
                n, eps_low, eps_high, clip_ratio_c, BLOCK=BLOCK,
            )  # fmt: skip
        ctx.save_for_backward(dlp)
        ctx.mark_non_differentiable(ratio, log_ratio, clip)
        return token_loss, ratio, log_ratio, clip

    @staticmethod
    def backward(ctx: Any, g_loss: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        (dlp,) = ctx.saved_tensors
        return (g_loss * dlp,) + (None,) * 7
