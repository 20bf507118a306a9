"""The experts a transformers mixture-of-experts model's routers pick while the embedded engine decodes, per row
and position: what SGLang's return_routed_experts reports, for rollout routing replay (actor.routing_replay=r3).

transformers' Qwen2-MoE / Qwen3-MoE routers (`mlp.gate`, a TopKRouter) return (logits, scores, indices) with
indices [tokens, top_k] over the block's input flattened row by row ([rows, positions] -> rows * positions). A
`RouteTape` hooks every router for one forward and writes the picks at the positions that forward read, beside
the decoder's attention mask, so a row's routes are its real (unpadded) positions in order: its prompt's tokens,
then each sampled token as it is fed back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from megatron_dapo.types import route_dtype


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Each MoE layer's router, in layer order ([] for a dense model)."""
    return [m for name, m in model.named_modules()
            if name.endswith("mlp.gate") and hasattr(m, "top_k") and hasattr(m, "num_experts")]


class RouteTape:
    """[rows, max_len, layers, top_k] routes of a decoder's rows, kept in step with its rows (`select`)."""

    def __init__(self, routers: list[torch.nn.Module], rows: int, max_len: int) -> None:
        self.routers = routers
        self.top_k = int(routers[0].top_k)
        self.tape = torch.zeros(rows, max_len, len(routers), self.top_k, dtype=route_dtype(int(routers[0].num_experts)))
        self._picked: list[Tensor] = []

    @contextmanager
    def reading(self, rows: int, width: int, start: int) -> Iterator[None]:
        """Record one forward over [rows, width] inputs written at positions start .. start + width."""
        self._picked = []
        handles = [r.register_forward_hook(self._hook) for r in self.routers]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
        if len(self._picked) != len(self.routers):
            raise RuntimeError(f"{len(self._picked)} of {len(self.routers)} MoE routers ran in a forward")
        picks = torch.stack(self._picked, 1).to("cpu", self.tape.dtype)  # [rows * width, layers, k]
        self.tape[:, start:start + width] = picks.view(rows, width, len(self.routers), self.top_k)
        self._picked = []

    def _hook(self, _module: torch.nn.Module, _inputs: Any, out: tuple[Tensor, Tensor, Tensor]) -> None:
        self._picked.append(out[2].detach())

    def select(self, rows: Tensor) -> None:
        self.tape = self.tape[rows.cpu()]

    def row(self, i: int, real: Tensor) -> Tensor:
        """Row i's routes at its real positions ([positions, layers, k]); `real`: its mask [max_len]."""
        return self.tape[i][real.cpu().bool()[: self.tape.shape[1]]].clone()


def read_routes(positions: Tensor | None, length: int) -> Tensor | None:
    """A sample's Sample.routes from its row's routes at every position the decoder read: the first
    prompt + response - 1 (the last response token is never read; a row that stopped may have read past it)."""
    if positions is None:
        return None
    if positions.shape[0] < length - 1:
        raise RuntimeError(f"the decoder read {positions.shape[0]} positions of a {length}-token sample")
    return positions[: length - 1].clone()
