"""Run under torchrun by tests/test_actor.py: one actor layout, results saved per rank.

    torchrun --nproc_per_node N tests/workers/actor_worker.py CASE HF_DIR OUT_DIR TP PP [CKPT]
"""

import os
import sys

import torch

from megatron_dapo import parallel
from megatron_dapo.actor.actor import Actor
from megatron_dapo.actor.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from megatron_dapo.actor.hf_io import export_hf_weights
from megatron_dapo.config import Config
from megatron_dapo.types import TrainBatch

VOCAB = 200


def fixed_batch() -> TrainBatch:
    g = torch.Generator().manual_seed(1234)
    lengths = torch.tensor([16, 11, 9, 16, 6, 13, 8, 12])
    b, s = len(lengths), int(lengths.max())
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    mask = torch.zeros(b, s)
    for i, n in enumerate(lengths.tolist()):
        ids[i, n:] = 0
        mask[i, 4:n] = 1.0
    mask[2, 6] = 0.0  # a hole (e.g. a filtered token)
    adv = torch.tensor([1.5, -0.5, -0.5, -0.5, 1.0, -1.0, 0.3, -0.3])
    return TrainBatch(input_ids=ids, loss_mask=mask, advantages=adv, lengths=lengths)


def make_cfg(tp: int, pp: int) -> Config:
    cfg = Config()
    cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel = tp, pp
    cfg.model.dtype = "float32"
    cfg.actor.optimizer.lr, cfg.actor.optimizer.warmup_steps = 1e-2, 0
    cfg.actor.optimizer.grad_clip, cfg.actor.optimizer.weight_decay = 0.0, 0.0
    cfg.actor.micro_batch_tokens = 48  # several micro-batches per mini-batch
    cfg.actor.logprob_micro_batch_tokens = 40
    cfg.actor.optimizer.distributed_optimizer = os.environ.get("DAPO_TEST_DISTOPT") == "1"
    return cfg


def dp_rows(batch: TrainBatch) -> TrainBatch:
    from megatron_dapo.actor.batching import split_rows

    return split_rows(batch, parallel.dp_size())[parallel.dp_rank()]


def main() -> None:
    case, hf_dir, out, tp, pp = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    cfg = make_cfg(tp, pp)
    parallel.initialize(cfg.parallel, seed=7)
    actor = Actor.from_hf(hf_dir, cfg.model, cfg.parallel, cfg.actor)
    result: dict = {"rank": parallel.global_rank(), "dp_rank": parallel.dp_rank(), "tp_rank": parallel.tp_rank()}
    batch = fixed_batch()
    # pi_old != pi_theta so that both clip bounds are exercised (a fixed pattern over the FULL batch)
    batch.old_logprobs = actor.compute_logprobs(batch)[0] + 0.3 * torch.sin(
        torch.arange(batch.input_ids.numel()).view_as(batch.input_ids) * 1.7)
    mine = dp_rows(batch)
    if case == "load":
        load_checkpoint(actor, latest_checkpoint(sys.argv[6]))
    result["logprobs"], result["entropy"] = actor.compute_logprobs(batch)
    if case == "train":
        result["metrics"] = actor.train_step(mine)
        result["grads"] = {n: t.clone() for n, t in export_hf_weights(actor.module, actor.spec, grads=True)}
        result["params"] = {n: t.clone() for n, t in export_hf_weights(actor.module, actor.spec)}
        result["logprobs_after"] = actor.compute_logprobs(batch)[0]
        if len(sys.argv) > 6:
            save_checkpoint(actor, sys.argv[6], step=1)
    if case in ("train", "load") and len(sys.argv) > 6:
        result["next_losses"] = [actor.train_step(mine)["loss"] for _ in range(2)]
    if case == "nan":
        before = {n: t.clone() for n, t in export_hf_weights(actor.module, actor.spec)}
        mine.advantages[0] = float("nan")
        result["metrics"] = actor.train_step(mine)
        after = dict(export_hf_weights(actor.module, actor.spec))
        result["unchanged"] = all(torch.equal(before[n], after[n]) for n in before)
        mine.advantages[0] = 1.0
        result["metrics_next"] = actor.train_step(mine)
    if case == "learn":
        result["losses"] = [actor.train_step(batch)["loss"] for _ in range(8)]
    torch.save(result, f"{out}/rank_{parallel.global_rank()}.pt")
    parallel.destroy()


if __name__ == "__main__":
    main()
