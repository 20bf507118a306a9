"""Chunked plain-torch statistics and gradient of the token logprob / entropy (CPU and fallback path).

Works on chunks of tokens sized by a memory budget: extra memory is O(chunk x V), never O(N x V).
The backward recomputes the softmax per chunk from the logits instead of saving log-softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_dapo.kernels.layout import row_chunks
from megatron_dapo.kernels.vocab_parallel import EMPTY_MAX, RowStats, empty_shard_stats

CPU_CHUNK_BYTES = 32 << 20
"""CPU budget for the per-chunk fp32 temporaries (two [chunk, V] tensors alive at once). Chunks that
stay near the cache make this path faster than the materialised one; much smaller ones pay per-op
overhead (and OpenMP barriers, badly so when other processes share the cores)."""
GPU_CHUNK_BYTES = 1 << 30


def default_chunk_bytes(device: torch.device) -> int:
    return CPU_CHUNK_BYTES if device.type == "cpu" else GPU_CHUNK_BYTES


LOG_FLOOR = -1e4
"""exp() of anything below is 0 in fp32; clamping there turns 0 * -inf into 0 * LOG_FLOOR = 0."""


def local_targets(targets: torch.Tensor, vocab_start: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index into this shard clamped to [0, V), whether the target lies in the shard)."""
    local = targets - vocab_start
    inside = (local >= 0) & (local < vocab)
    return local.clamp(0, vocab - 1), inside


def _load_fp32(view: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """The chunk view times `scale` as fp32 [n, V]: a view when it already is fp32, row-contiguous and
    unscaled, else one chunk-sized copy (the scaling, an inverse temperature, happens in that copy)."""
    flat = view.reshape(-1, view.shape[-1]) if view.dtype == torch.float32 and scale == 1.0 else None
    if flat is not None and flat.stride(-1) == 1:
        return flat
    out = torch.empty(view.shape, dtype=torch.float32, device=view.device).copy_(view)
    return (out.mul_(scale) if scale != 1.0 else out).view(-1, view.shape[-1])


def chunk_stats(z: torch.Tensor, index: torch.Tensor, inside: torch.Tensor, entropy: bool) -> RowStats:
    """RowStats of the fp32 chunk z [n, V]; z is read only. (torch.logsumexp would add passes.)"""
    target_logit = torch.where(inside, z.gather(1, index[:, None]).squeeze(1), 0.0)
    m = z.amax(dim=1).clamp_min_(EMPTY_MAX)
    d = z - m[:, None]
    if not entropy:
        return RowStats(m, d.exp_().sum(dim=1), None, target_logit)
    e = torch.exp(d)
    w = d.mul_(e).sum(dim=1)
    if torch.isnan(w).any():  # 0 * -inf from a -inf logit: redo the chunk with d floored
        d = torch.sub(z, m[:, None]).clamp_min_(LOG_FLOOR)
        w = d.mul_(e).sum(dim=1)
    return RowStats(m, e.sum(dim=1), w, target_logit)


def chunk_grad(
    z: torch.Tensor,
    index: torch.Tensor,
    inside: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    g_lp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
) -> torch.Tensor:
    """d(sum g_lp * logprob + g_ent * entropy) / dz for the fp32 chunk z [n, V] (z is read only).

    dlogprob/dz_j = [j = target] - p_j;  dentropy/dz_j = -p_j (log p_j + entropy), so
    grad_j = p_j (a + b log p_j) + [j = target] g_lp  with  a = -(g_lp + g_ent entropy), b = -g_ent.
    """
    logp = torch.sub(z, lse[:, None])
    if g_ent is None:
        grad = logp.exp_().mul_(-g_lp[:, None])
    else:
        p = torch.exp(logp.clamp_min_(LOG_FLOOR))
        a = -g_ent * entropy if g_lp is None else -(g_lp + g_ent * entropy)
        grad = torch.addcmul(a[:, None], logp, -g_ent[:, None]).mul_(p)
    if g_lp is not None:
        grad.scatter_add_(1, index[:, None], torch.where(inside, g_lp, 0.0)[:, None])
    return grad


@dataclass(frozen=True)
class TorchBackend:
    """Chunked torch implementation of the two passes the autograd Function needs."""

    chunk_bytes: int | None = None
    """None: default_chunk_bytes of the logits' device."""
    scale: float = 1.0
    """Multiplies the logits before the softmax (1 / temperature), chunk by chunk: no scaled copy."""

    def chunk_rows(self, rows: torch.Tensor) -> int:
        budget = self.chunk_bytes or default_chunk_bytes(rows.device)
        return max(1, budget // (2 * 4 * max(rows.shape[-1], 1)))

    def stats(self, rows: torch.Tensor, targets: torch.Tensor, vocab_start: int, entropy: bool) -> RowStats:
        vocab = rows.shape[-1]
        if vocab == 0:
            return empty_shard_stats(targets.shape[0], rows.device, entropy)
        parts = [
            chunk_stats(_load_fp32(view, self.scale), *local_targets(targets[r0:r1], vocab_start, vocab), entropy)
            for r0, r1, view in row_chunks(rows, self.chunk_rows(rows))
        ]
        m, s, w, zt = (None if f[0] is None else torch.cat(f) for f in zip(*parts))
        return RowStats(m, s, w, zt)

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
        """Write the logits gradient into `out` (same shape as `rows`; may be `rows` itself)."""
        vocab = rows.shape[-1]
        if vocab == 0:
            return
        out_chunks = row_chunks(out, self.chunk_rows(rows))
        for (r0, r1, view), (_, _, out_view) in zip(row_chunks(rows, self.chunk_rows(rows)), out_chunks):
            sl = slice(r0, r1)
            grad = chunk_grad(
                _load_fp32(view, self.scale),
                *local_targets(targets[sl], vocab_start, vocab),
                lse[sl],
                None if entropy is None else entropy[sl],
                None if g_lp is None else g_lp[sl],
                None if g_ent is None else g_ent[sl],
            )
            if self.scale != 1.0:
                grad.mul_(self.scale)  # d/dz of f(scale * z)
            out_view.copy_(grad.view(out_view.shape))
