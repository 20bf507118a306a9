"""The trainer under torchrun, optionally with the earlier rollout distribution (the whole
batch pickled to every rank, each keeping its rows) as the reference for tests/test_distribute.py.

    torchrun --nproc_per_node 2 tests/workers/train_worker.py [--broadcast] --config ... [overrides]
"""

import sys

import torch.distributed as dist

from megatron_dapo import parallel, train
from megatron_dapo.actor.batching import split_rows
from megatron_dapo.loop import distribute


def broadcast_scatter(batch):
    """The old path: broadcast_object_list of the driver's whole batch, every rank keeps its rows."""
    box = [batch]
    dist.broadcast_object_list(box, src=0)
    batch = box[0]
    mine = None if batch is None else split_rows(batch, parallel.dp_size())[parallel.dp_rank()]
    return mine, distribute.Transfer()


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--broadcast":
        distribute.scatter = broadcast_scatter
        args = args[1:]
    sys.exit(train.main(args))
