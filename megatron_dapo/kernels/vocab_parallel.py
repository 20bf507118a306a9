"""Partial softmax statistics of one vocab shard, and their combination across tensor-parallel ranks.

For the logits z of one token over the shard's vocab slice, relative to the shard max m:

    S = sum_j exp(z_j - m)                (sum-exp)
    W = sum_j exp(z_j - m) * (z_j - m)    (entropy term; 0 * -inf counts as 0)

Over the full vocab with global max M and a_r = exp(m_r - M):

    S = sum_r a_r S_r,   W = sum_r a_r (W_r + (m_r - M) S_r)
    lse = M + log S,     entropy = log S - W / S,     logprob = z_target - lse

so the ranks exchange one MAX all-reduce of [N] and one SUM all-reduce of [3, N]; no [N, V] gather.
The target logit is summed too: exactly one rank holds it, the others contribute 0. A shard without
columns (Megatron pads a small vocabulary so that a TP rank may hold padding only) has m = EMPTY_MAX
and S = W = 0: a_r = 0, it adds nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

EMPTY_MAX = -1e30
"""Running max before any finite logit: finite so that (m - M) * S stays 0 instead of nan."""


class RowStats(NamedTuple):
    """Per-token fp32 [N] statistics of one vocab shard (see the module docstring)."""

    max: torch.Tensor
    sum_exp: torch.Tensor
    ent_term: torch.Tensor | None
    target_logit: torch.Tensor


def empty_shard_stats(n: int, device: torch.device, entropy: bool) -> RowStats:
    """The statistics of a zero-width shard for n tokens."""
    zeros = torch.zeros(n, dtype=torch.float32, device=device)
    ent_term = zeros.clone() if entropy else None
    return RowStats(torch.full_like(zeros, EMPTY_MAX), zeros, ent_term, zeros.clone())


def tp_world_size(group: dist.ProcessGroup | None) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def combine(
    stats: RowStats, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(lse, logprob, entropy) of the full distribution; entropy is None when `ent_term` is."""
    m, s, w, zt = stats
    if tp_world_size(group) > 1:
        m_global = m.clone()
        dist.all_reduce(m_global, op=dist.ReduceOp.MAX, group=group)
        scale = torch.exp(m - m_global)
        parts = [s * scale, zt] if w is None else [s * scale, zt, scale * (w + (m - m_global) * s)]
        packed = torch.stack(parts)
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        m, s, zt = m_global, packed[0], packed[1]
        w = None if w is None else packed[2]
    log_s = torch.log(s)
    lse = m + log_s
    entropy = None if w is None else log_s - w / s
    return lse, zt - lse, entropy
