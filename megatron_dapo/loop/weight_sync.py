"""Weight sync, actor -> rollout engines: every rank streams the HF-named full tensors in the model's dtype
(TP gathered, PP stages collected) and hands them to its part of the rollout side:
- SGLang (`NodeWeightSync`, rollout/sglang/updates.py): every rank takes part in updating its own node's
  servers (on GPU each rank serialises the payload of the server TP rank on its GPU); no weight byte crosses
  nodes when a node holds a whole actor replica;
- the embedded engine: the driver (the rank that holds it) feeds it; the other ranks only stream.

Besides the stream's size, the stats count what global rank 0 sent to the engines and what crossed a node
boundary (PP stages received from another node, engine-bound bytes to another node's servers), summed over
every rank, so the step's monitors show a layout's traffic.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_dapo import parallel
from megatron_dapo.actor.hf_io import hf_weight_stream
from megatron_dapo.actor.model import ModelSpec
from megatron_dapo.loop.weight_probe import WeightSyncError
from megatron_dapo.rollout.base import RolloutEngine
from megatron_dapo.rollout.sglang.updates import NodeWeightSync
from megatron_dapo.schedule.pipeline import WeightSnapshot


@dataclass
class SyncStats:
    tensors: int = 0
    bytes: int = 0
    """Of the stream: one model in the model's dtype."""
    seconds: float = 0.0
    bytes_sent_rank0: int = 0
    """Weight bytes global rank 0 handed to rollout engines."""
    bytes_cross_node: int = 0
    """Weight bytes that crossed a node boundary, every rank's summed."""

    def scalars(self) -> dict[str, float]:
        return {"perf/weight_sync_bytes": float(self.bytes),
                "perf/weight_sync_bytes_sent_rank0": float(self.bytes_sent_rank0),
                "perf/weight_sync_bytes_cross_node": float(self.bytes_cross_node)}


def sync_weights(module: torch.nn.Module, spec: ModelSpec,
                 target: NodeWeightSync | RolloutEngine | WeightSnapshot | None,
                 dtype: torch.dtype | None = None) -> SyncStats:
    """Collective over all ranks. `target`: this rank's NodeWeightSync (SGLang, every rank), or the engine on
    the rank that holds it, or the WeightSnapshot that keeps the weights for it (None elsewhere). `dtype`:
    default the model's own."""
    initialized = dist.is_available() and dist.is_initialized()
    nodes = _nodes_of_ranks() if initialized else [0]
    me = dist.get_rank() if initialized else 0
    stats, cross = SyncStats(), [0]
    t0 = time.perf_counter()

    def received(source: int, nbytes: int) -> None:
        if nodes[source] != nodes[me]:
            cross[0] += nbytes

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in hf_weight_stream(module, spec, dtype, received=received):
            stats.tensors += 1
            stats.bytes += t.numel() * t.element_size()
            yield name, t

    sent, error, stream = 0, None, counted()
    if isinstance(target, NodeWeightSync):
        counts = target.update(stream)
        sent, error = counts.sent, counts.error
    elif target is not None:
        try:
            target.update_weights(stream)
            sent = stats.bytes
        except Exception as e:  # noqa: BLE001 - raised below, on every rank
            error = e
    for _ in stream:  # the rest (all of it without a target, after a failure): every rank's collectives end
        pass
    totals = _exchange(sent, cross[0], error, initialized, me)
    stats.bytes_sent_rank0, stats.bytes_cross_node = totals
    stats.seconds = time.perf_counter() - t0
    return stats


def _nodes_of_ranks() -> list[int]:
    nodes: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(nodes, parallel.launch_env().node_rank)
    return nodes


def _exchange(sent: int, cross: int, error: BaseException | None, initialized: bool, me: int
              ) -> tuple[int, int]:
    """(rank 0's sent bytes, cross-node bytes of all ranks); any rank's failure raised on every rank."""
    if not initialized or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return sent, cross
    mine = (sent, cross, None if error is None else f"{type(error).__name__}: {error}")
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    failed = [f"rank {r}: {e}" for r, (_, _, e) in enumerate(every) if e is not None]
    if failed:
        raise WeightSyncError("weight sync failed on " + "; ".join(failed)) from error
    return every[0][0], sum(c for _, c, _ in every)
