"""Getting the driver's rollout to the ranks that train on it: each data-parallel rank trains its rows."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from megatron_dapo import parallel
from megatron_dapo.actor.batching import split_rows
from megatron_dapo.algo.train_batch import build_train_batch
from megatron_dapo.types import Group, TrainBatch


def share(obj: Any) -> Any:
    """The driver's object on every rank (a collective; identity in a one-process run)."""
    if parallel.world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def trainable(groups: list[Group], num_mini_batches: int) -> list[Group]:
    """Trim a (partial) batch to whole mini-batches that split evenly over DP ranks."""
    unit = parallel.dp_size() * num_mini_batches
    return groups[: len(groups) // unit * unit]


def local_batch(groups: list[Group], *, overlong_filtering: bool, pad_id: int) -> TrainBatch:
    """Advantages over the groups, then this data-parallel rank's contiguous share of the rows."""
    batch = build_train_batch(groups, overlong_filtering=overlong_filtering, pad_id=pad_id)
    return split_rows(batch, parallel.dp_size())[parallel.dp_rank()]
