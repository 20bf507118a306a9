"""The colocation protocol of the hybrid engine, in one place: which side holds the devices when.

Rank 0's rollout engine and every rank's actor share the devices (`rollout.colocate`): the engine
sleeps while the actor computes pi_old and updates; after the update the engine wakes and takes the
new weights, streamed from the actor (gather TP shards, collect PP stages, convert to HF names,
tensor by tensor into the engine, which buckets them for its transport).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megatron_dapo.actor.actor import Actor
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


@dataclass
class Phases:
    """Moves the devices between the rollout engine (driver rank only) and the actor (every rank)."""

    actor: Actor
    engine: RolloutEngine | None
    colocate: bool

    def train(self) -> None:
        """The actor takes the devices: the engine releases its memory."""
        if self.engine is not None and self.colocate:
            self.engine.sleep()
        self.actor.wake()

    def sync(self) -> SyncStats:
        """The engine wakes and takes the actor's current weights (collective over all ranks)."""
        if self.engine is not None and self.colocate:
            self.engine.wake()
        stats = sync_weights(self.actor.module, self.actor.spec, self.engine)
        if self.colocate:
            self.actor.sleep()
            self.actor.wake()  # CPU: no-op pair; GPU: the actor's memory was free during the rollout
        return stats
