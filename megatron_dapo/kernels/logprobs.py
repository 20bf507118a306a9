"""Per-token logprob of the target and entropy, vocab-parallel, without materialising log-softmax.

One autograd Function serves both implementations; a backend supplies the two passes over the
logits (statistics in forward, recomputed softmax in backward): `TorchBackend` (chunked, any
device) or `TritonBackend` (streaming kernels, CUDA, or CPU under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megatron_dapo.kernels.layout import as_rows
from megatron_dapo.kernels.logprobs_torch import TorchBackend
from megatron_dapo.kernels.vocab_parallel import RowStats, combine

IMPLS = ("auto", "torch", "triton")
IMPL_ENV = "MEGATRON_DAPO_KERNEL_IMPL"
"""Overrides impl="auto" (the default) with "torch" or "triton"; an explicit impl argument wins."""


class Backend(Protocol):
    def stats(
        self, rows: torch.Tensor, targets: torch.Tensor, vocab_start: int, entropy: bool
    ) -> RowStats: ...

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
    ) -> None: ...


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def resolve_impl(impl: str, device: torch.device) -> str:
    """ "torch" or "triton" for a call on `device`; ValueError for an unknown or unusable choice."""
    if impl not in IMPLS:
        raise ValueError(f"unknown kernel impl {impl!r}; valid: {', '.join(IMPLS)}")
    if impl == "auto":
        impl = os.environ.get(IMPL_ENV) or "auto"
        if impl not in IMPLS:
            raise ValueError(f"{IMPL_ENV}={impl!r}; valid: {', '.join(IMPLS)}")
    if impl == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if impl == "triton":
        if not triton_available():
            raise ValueError("impl='triton' but triton is not installed")
        if device.type != "cuda" and not interpreting():
            raise ValueError(
                "impl='triton' on a CPU tensor needs TRITON_INTERPRET=1 set before the kernels load"
            )
    return impl


def get_backend(impl: str, chunk_bytes: int | None = None, temperature: float = 1.0) -> Backend:
    """The backend computing on logits / temperature (folded into its loads: no scaled copy)."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if impl == "triton":
        from megatron_dapo.kernels.logprobs_triton import TritonBackend

        return TritonBackend(scale=1.0 / temperature)
    return TorchBackend(chunk_bytes, scale=1.0 / temperature)


class LogprobsEntropy(torch.autograd.Function):
    """rows [A, B, V] logits, targets [A*B] global ids -> fp32 (logprob [A*B], entropy [A*B] or None).

    Only the first `valid` columns are the distribution (Megatron pads the vocab); the others get a
    zero gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        rows: torch.Tensor,
        targets: torch.Tensor,
        backend: Backend,
        vocab_start: int,
        group: dist.ProcessGroup | None,
        compute_entropy: bool,
        inplace_backward: bool,
        valid: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        stats = backend.stats(rows[..., :valid], targets, vocab_start, compute_entropy)
        lse, logprob, entropy = combine(stats, group)
        ctx.save_for_backward(rows, targets, lse, entropy)
        ctx.backend, ctx.vocab_start, ctx.inplace, ctx.valid = backend, vocab_start, inplace_backward, valid
        ctx.set_materialize_grads(False)
        return logprob, entropy

    @staticmethod
    def backward(ctx: Any, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None) -> tuple[Any, ...]:
        rows, targets, lse, entropy = ctx.saved_tensors
        if g_ent is not None and (entropy is None or not bool(g_ent.any())):
            g_ent = None  # entropy is a monitor only: skip its term (one [N] check, no [N, V] work)
        if g_lp is None and g_ent is None:
            return (None,) * 8
        g_lp = None if g_lp is None else g_lp.reshape(-1).float()
        g_ent = None if g_ent is None else g_ent.reshape(-1).float()
        out = rows if ctx.inplace else torch.empty_like(rows)
        valid = ctx.valid
        ctx.backend.grad(rows[..., :valid], targets, ctx.vocab_start, lse, entropy, g_lp, g_ent, out[..., :valid])
        if valid < out.shape[-1]:
            out[..., valid:].zero_()
        if ctx.inplace:
            torch.autograd.graph.increment_version(rows)  # a second backward now fails loudly
        return (out,) + (None,) * 7


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    compute_entropy: bool = True,
    impl: str = "auto",
    inplace_backward: bool = False,
    chunk_bytes: int | None = None,
    temperature: float = 1.0,
    vocab_valid: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 logprob of each target token and entropy of each token's full-vocab distribution.

    Args:
        logits: [..., V_local] in any float dtype and layout; with `tp_group` of >1 ranks, this rank's
            vocab shard covering global ids [vocab_start, vocab_start + V_local).
        targets: [...] int64 GLOBAL vocab ids; ids outside the shard contribute 0 here (an id outside
            the whole vocab, e.g. a padding -100, gives a meaningless logprob instead of an error).
        compute_entropy: False returns None for the entropy and skips its work.
        impl: "auto" (Triton on CUDA when installed, else torch), "torch" or "triton"; env
            MEGATRON_DAPO_KERNEL_IMPL overrides "auto".
        inplace_backward: write the logits gradient into the logits' own storage (no [N, V]
            allocation). Only for logits used by nothing else after this call (e.g. straight from
            the output layer); a non-leaf is required and retain_graph double backward is refused.
        chunk_bytes: the torch path's temporary-memory budget per chunk of tokens.
        temperature: the distribution is softmax(logits / temperature); the division happens as the
            kernels load the logits (no scaled copy), the gradient is w.r.t. the unscaled logits.
        vocab_valid: only the first vocab_valid columns of this shard are vocabulary (the rest is
            Megatron's padding: excluded from the softmax, zero gradient). None: all of them.

    Both outputs are differentiable w.r.t. logits. When the entropy gets no gradient (or a zero
    one), the backward skips the entropy term.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets {tuple(targets.shape)} must be logits {tuple(logits.shape)} less the vocab dim"
        )
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if inplace_backward and logits.is_leaf and logits.requires_grad:
        raise ValueError("inplace_backward would overwrite a leaf tensor; pass a non-leaf")
    width = logits.shape[-1]
    valid = width if vocab_valid is None else vocab_valid
    if not 0 <= valid <= width:
        raise ValueError(f"vocab_valid={vocab_valid} must be in [0, {width}] (the logits' last dim)")
    backend = get_backend(resolve_impl(impl, logits.device), chunk_bytes, temperature)
    rows = as_rows(logits)
    flat_targets = targets.reshape(-1).to(device=logits.device, dtype=torch.int64)
    logprob, entropy = LogprobsEntropy.apply(
        rows, flat_targets, backend, vocab_start, tp_group, compute_entropy, inplace_backward, valid
    )
    logprob = logprob.view(targets.shape)
    return logprob, None if entropy is None else entropy.view(targets.shape)
