"""Weight sync, actor -> rollout engine: every rank streams the HF-named full tensors (TP gathered, PP
stages collected); the driver (the rank holding the engine) feeds them to the engine, which buckets
them for its transport."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megatron_dapo.actor.hf_io import hf_weight_stream
from megatron_dapo.actor.model import ModelSpec
from megatron_dapo.rollout.base import RolloutEngine


@dataclass
class SyncStats:
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0


def sync_weights(module: torch.nn.Module, spec: ModelSpec, engine: RolloutEngine | None,
                 dtype: torch.dtype = torch.float32) -> SyncStats:
    """Collective over all ranks; the driver (the rank that holds `engine`) feeds the engine."""
    stats = SyncStats()
    t0 = time.perf_counter()

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in hf_weight_stream(module, spec, dtype):
            stats.tensors += 1
            stats.bytes += t.numel() * t.element_size()
            yield name, t

    if engine is not None:
        engine.update_weights(counted())
    else:
        for _ in counted():
            pass
    stats.seconds = time.perf_counter() - t0
    return stats
