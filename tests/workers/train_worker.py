"""The trainer under torchrun, optionally with the earlier rollout distribution (the whole
rollout pickled to every rank, each keeping its rows) as the reference for tests/test_distribute.py.

    torchrun --nproc_per_node 2 tests/workers/train_worker.py [--broadcast] --config ... [overrides]
"""

import sys

import torch.distributed as dist

from megatron_dapo import parallel, train
from megatron_dapo.actor.batching import split_rows
from megatron_dapo.algo.train_batch import build_train_batch
from megatron_dapo.loop import distribute


def broadcast_rows(rollout, *, num_mini_batches, overlong_filtering, pad_id, scale_by_std=True):
    """The old path: broadcast_object_list of the StepRollout, then every rank builds the whole batch."""
    box = [rollout]
    dist.broadcast_object_list(box, src=0)
    rollout = box[0]
    groups = distribute.trainable(rollout.groups, num_mini_batches)
    samples = sum(len(g.samples) for g in rollout.generated)
    if not groups:
        return distribute.StepRows(None, 0, samples)
    batch = build_train_batch(groups, overlong_filtering=overlong_filtering, pad_id=pad_id,
                              scale_by_std=scale_by_std)
    return distribute.StepRows(split_rows(batch, parallel.dp_size())[parallel.dp_rank()], len(groups), samples)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--broadcast":
        distribute.step_rows = broadcast_rows
        args = args[1:]
    sys.exit(train.main(args))
