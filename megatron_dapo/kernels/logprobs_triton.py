"""Triton kernels for the token logprob / entropy: one streaming pass forward, one backward.

Each program owns one token (row) and walks its vocab shard in BLOCK_V blocks with an online
log-sum-exp, so no [N, V] intermediate exists. The backward recomputes p block by block from the
saved [N] log-sum-exp. Rows are addressed as [A, B, V] with three strides (see layout.py), math is
fp32 whatever the logits dtype, and offsets are int64 (N * V passes 2**31 at 16k x 152k).

Imported only when impl resolves to "triton": on CPU that needs TRITON_INTERPRET=1 set before
this module is imported (the @triton.jit decorator reads it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megatron_dapo.kernels.logprobs_torch import LOG_FLOOR
from megatron_dapo.kernels.vocab_parallel import EMPTY_MAX, RowStats, empty_shard_stats

MAX_BLOCK_V = 4096
_EMPTY_MAX: tl.constexpr = tl.constexpr(EMPTY_MAX)
_LOG_FLOOR: tl.constexpr = tl.constexpr(LOG_FLOOR)


@triton.jit
def _row_offset(row, num_b, stride_a, stride_b):
    return (row // num_b) * stride_a + (row % num_b) * stride_b


@triton.jit
def _stats_kernel(
    x_ptr, num_b, stride_a, stride_b, stride_v,
    tgt_ptr, vocab_start, vocab, inv_temp,
    max_ptr, sum_ptr, ent_ptr, zt_ptr,
    BLOCK_V: tl.constexpr, ENTROPY: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_ptr += _row_offset(row, num_b, stride_a, stride_b)
    cols = tl.arange(0, BLOCK_V)
    m = tl.full((), _EMPTY_MAX, tl.float32)
    s = tl.zeros((), tl.float32)
    w = tl.zeros((), tl.float32)
    for start in range(0, vocab, BLOCK_V):
        idx = start + cols
        z = tl.load(x_ptr + idx * stride_v, mask=idx < vocab, other=-float("inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(z, axis=0))
        scale = tl.exp(m - m_new)
        d = z - m_new
        e = tl.exp(d)
        if ENTROPY:
            w = scale * (w + (m - m_new) * s) + tl.sum(e * tl.maximum(d, _LOG_FLOOR), axis=0)
        s = s * scale + tl.sum(e, axis=0)
        m = m_new
    t = tl.load(tgt_ptr + row) - vocab_start
    inside = (t >= 0) & (t < vocab)
    zt = tl.load(x_ptr + tl.where(inside, t, 0) * stride_v, mask=inside, other=0.0).to(tl.float32) * inv_temp
    tl.store(max_ptr + row, m)
    tl.store(sum_ptr + row, s)
    tl.store(zt_ptr + row, zt)
    if ENTROPY:
        tl.store(ent_ptr + row, w)


@triton.jit
def _grad_kernel(
    x_ptr, num_b, stride_a, stride_b, stride_v,
    out_ptr, out_stride_a, out_stride_b, out_stride_v,
    tgt_ptr, vocab_start, vocab, inv_temp,
    lse_ptr, ent_ptr, g_lp_ptr, g_ent_ptr,
    BLOCK_V: tl.constexpr, HAS_LP: tl.constexpr, HAS_ENT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_ptr += _row_offset(row, num_b, stride_a, stride_b)
    out_ptr += _row_offset(row, num_b, out_stride_a, out_stride_b)
    cols = tl.arange(0, BLOCK_V)
    lse = tl.load(lse_ptr + row)
    t = tl.load(tgt_ptr + row) - vocab_start
    g_lp = tl.load(g_lp_ptr + row) if HAS_LP else 0.0
    if HAS_ENT:
        ent = tl.load(ent_ptr + row)
        g_ent = tl.load(g_ent_ptr + row)
    for start in range(0, vocab, BLOCK_V):
        idx = start + cols
        z = tl.load(x_ptr + idx * stride_v, mask=idx < vocab, other=-float("inf")).to(tl.float32) * inv_temp
        logp = z - lse
        p = tl.exp(logp)
        g = -g_lp * p
        if HAS_ENT:
            g -= g_ent * p * (tl.maximum(logp, _LOG_FLOOR) + ent)
        g = tl.where(idx == t, g + g_lp, g) * inv_temp
        tl.store(out_ptr + idx * out_stride_v, g.to(out_ptr.dtype.element_ty), mask=idx < vocab)


def block_v(vocab: int) -> int:
    """The vocab tile: the whole shard when small, else MAX_BLOCK_V (read at call time)."""
    return min(MAX_BLOCK_V, triton.next_power_of_2(max(vocab, 16)))


@dataclass(frozen=True)
class TritonBackend:
    """Launches the kernels above; one program per token."""

    scale: float = 1.0
    """Multiplies the logits as they are loaded (1 / temperature); the gradient gets the same factor."""

    def stats(self, rows: torch.Tensor, targets: torch.Tensor, vocab_start: int, entropy: bool) -> RowStats:
        num_a, num_b, vocab = rows.shape
        n = num_a * num_b
        if vocab == 0:  # no launch: an empty tensor may have no device pointer at all
            return empty_shard_stats(n, rows.device, entropy)
        m, s, w, zt = (torch.empty(n, dtype=torch.float32, device=rows.device) for _ in range(4))
        if n:
            _stats_kernel[(n,)](
                rows, num_b, rows.stride(0), rows.stride(1), rows.stride(2),
                targets, vocab_start, vocab, self.scale, m, s, w, zt,
                BLOCK_V=block_v(vocab), ENTROPY=entropy,
            )  # fmt: skip
        return RowStats(m, s, w if entropy else None, zt)

    def grad(
        self,
        rows: torch.Tensor,
        targets: torch.Tensor,
        vocab_start: int,
        lse: torch.Tensor,
        entropy: torch.Tensor | None,
        g_lp: torch.Tensor | None,
        g_ent: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        num_a, num_b, vocab = rows.shape
        if num_a * num_b * vocab == 0:
            return
        has_ent = g_ent is not None
        _grad_kernel[(num_a * num_b,)](
            rows, num_b, rows.stride(0), rows.stride(1), rows.stride(2),
            out, out.stride(0), out.stride(1), out.stride(2),
            targets, vocab_start, vocab, self.scale,
            lse, entropy if has_ent else lse, lse if g_lp is None else g_lp.contiguous(),
            g_ent.contiguous() if has_ent else lse,
            BLOCK_V=block_v(vocab), HAS_LP=g_lp is not None, HAS_ENT=has_ent,
        )  # fmt: skip
