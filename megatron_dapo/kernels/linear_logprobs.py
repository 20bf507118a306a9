"""Token logprob + entropy straight from hidden states and the lm-head weight (the output projection
fused in): full [N, V] logits never exist, only a [chunk, V] block of them at a time.

Forward: per token chunk, logits = hidden @ weight^T, then the backend's streaming statistics;
one combine (all-reduce) for all tokens. Backward: per chunk, recompute the logits, turn them into
their gradient in place (the backend's grad pass), then grad_hidden = g @ weight and
grad_weight += g^T @ hidden (accumulated in fp32). Costs one extra matmul (the recompute), saves
the [N, V] logits and their gradient: the Cut-Cross-Entropy / Liger fused-linear trade. When all N
rows' logits fit `keep_bytes` (LINEAR_KEEP_BYTES: the logits budget the actor's micro-batches are sized
by, config/sizing.py), the forward computes them as one block and keeps it for the backward instead: no
recompute (a quarter of the output layer's FLOPs), and no more memory than the budget the batch assumed.

Tensor parallel: `weight` is this rank's vocab shard [V_local, H] and `hidden` is replicated on the
TP ranks; the backward all-reduces grad_hidden over `tp_group` itself (so do NOT also wrap `hidden`
in Megatron's copy_to_tensor_model_parallel_region).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_dapo.kernels.logprobs import Backend, get_backend, resolve_impl
from megatron_dapo.kernels.vocab_parallel import RowStats, combine, tp_world_size

LINEAR_CHUNK_BYTES = {"cpu": 64 << 20, "cuda": 2 << 30}
"""Budget of one [chunk, V_local] logits block (the backend bounds its own fp32 temporaries). Large
chunks matter: every chunk also reads and writes the whole [V, H] weight gradient. On CPU the budget
is also the loss's memory floor next to a small model (tools/bench_actor.py --memory)."""
LINEAR_KEEP_BYTES = {"cpu": 256 << 20, "cuda": 2 << 30}
"""Logits up to this size are kept from the forward for the backward (config/sizing.py's LOGITS_BUDGET)."""


def _rows(weight: torch.Tensor, nbytes: int | None, budgets: dict[str, int]) -> int:
    """Rows of [rows, V_local] logits in `nbytes` (None: the device's budget)."""
    budget = budgets.get(weight.device.type, budgets["cuda"]) if nbytes is None else nbytes
    return budget // (max(weight.shape[0], 1) * weight.element_size())


class LinearLogprobsEntropy(torch.autograd.Function):
    """hidden [N, H], weight [V_local, H], targets [N] -> fp32 (logprob [N], entropy [N] or None)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        backend: Backend,
        vocab_start: int,
        group: dist.ProcessGroup | None,
        compute_entropy: bool,
        chunk_rows: int,
        keep_rows: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        keep = any(ctx.needs_input_grad[:2]) and 0 < hidden.shape[0] <= keep_rows
        step = hidden.shape[0] if keep else chunk_rows
        parts = []
        for r0 in range(0, hidden.shape[0], step):
            logits = (hidden[r0 : r0 + step] @ weight.T).unsqueeze(0)
            parts.append(backend.stats(logits, targets[r0 : r0 + step], vocab_start, compute_entropy))
        ctx.kept = logits if keep else None  # the backward turns it into its gradient: no recompute
        columns = [torch.cat(c) if c[0] is not None else None for c in zip(*parts)] if parts else None
        empty = torch.empty(0, device=hidden.device)
        stats = (
            RowStats(*columns)
            if columns
            else RowStats(empty, empty, empty if compute_entropy else None, empty)
        )
        lse, logprob, entropy = combine(stats, group)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.backend, ctx.vocab_start, ctx.group, ctx.chunk_rows = backend, vocab_start, group, chunk_rows
        ctx.set_materialize_grads(False)
        return logprob, entropy

    @staticmethod
    def backward(ctx: Any, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None) -> tuple[Any, ...]:
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        if g_ent is not None and (entropy is None or not bool(g_ent.any())):
            g_ent = None
        kept, ctx.kept = ctx.kept, None
        if g_lp is None and g_ent is None:
            return (None,) * 9
        want_h, want_w = ctx.needs_input_grad[:2]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        step = hidden.shape[0] if kept is not None else ctx.chunk_rows
        for r0 in range(0, hidden.shape[0], step):
            sl = slice(r0, r0 + step)
            h = hidden[sl]
            g = kept if kept is not None else (h @ weight.T).unsqueeze(0)
            ctx.backend.grad(g, targets[sl], ctx.vocab_start, lse[sl],
                             None if entropy is None else entropy[sl],
                             None if g_lp is None else g_lp[sl].float().contiguous(),
                             None if g_ent is None else g_ent[sl].float().contiguous(), g)  # fmt: skip
            g = g.squeeze(0)
            if want_h:
                torch.mm(g, weight, out=grad_h[sl])
            if want_w and grad_w.dtype == g.dtype:
                grad_w.addmm_(g.T, h)
            elif want_w:
                grad_w += g.T @ h  # low-precision partial product, accumulated in fp32
        if want_h and tp_world_size(ctx.group) > 1:
            dist.all_reduce(grad_h, group=ctx.group)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), *(None,) * 7


def linear_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    compute_entropy: bool = True,
    impl: str = "auto",
    chunk_bytes: int | None = None,
    keep_bytes: int | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """token_logprobs_and_entropy(hidden @ weight^T, targets, ...) without materialising the logits.

    Args:
        hidden: [..., H] (replicated across `tp_group`); weight: [V_local, H], rows = vocab ids
            [vocab_start, vocab_start + V_local); targets: [...] global ids.
        chunk_bytes: memory budget of one [chunk, V_local] logits block (LINEAR_CHUNK_BYTES by device).
        keep_bytes: with a gradient, all rows' logits up to this size are kept for the backward instead of
            recomputed (LINEAR_KEEP_BYTES by device; 0 = always recompute).
        temperature: softmax(hidden @ weight^T / temperature), folded into the kernels' loads.
        Megatron's vocab padding: pass only the valid rows of the weight (a view, e.g. weight[:valid]).
    """
    if hidden.shape[:-1] != targets.shape or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"need hidden [..., H], weight [V, H], targets [...]; got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(targets.shape)}")  # fmt: skip
    backend = get_backend(resolve_impl(impl, hidden.device), temperature=temperature)
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1).to(device=hidden.device, dtype=torch.int64)
    logprob, entropy = LinearLogprobsEntropy.apply(
        flat_h,
        weight,
        flat_t,
        backend,
        vocab_start,
        tp_group,
        compute_entropy,
        max(1, _rows(weight, chunk_bytes or None, LINEAR_CHUNK_BYTES)),
        _rows(weight, keep_bytes, LINEAR_KEEP_BYTES),
    )
    logprob = logprob.view(targets.shape)
    return logprob, None if entropy is None else entropy.view(targets.shape)
