"""Run under torchrun by tests/test_actor.py: actor layouts, results saved per rank.

    torchrun --nproc_per_node N tests/workers/actor_worker.py plan PLAN_JSON

The plan is a list of runs of this world size, each a dict: case, hf_dirs, out, tp, pp, ckpt, env (its DAPO_TEST_*
variables). They run in turn in one launch (a launch costs more than most runs), the model-parallel groups rebuilt
for each. Each HF folder of a run is trained in turn on its layout; results are keyed by the folder's name, in
OUT/rank_<i>.pt. The checkpoint (ckpt) belongs to the first folder.
"""

import json
import os
import sys
from pathlib import Path

import torch

from megatron_dapo import parallel
from megatron_dapo.actor.actor import Actor
from megatron_dapo.actor.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from megatron_dapo.actor.hf_io import export_hf_weights
from megatron_dapo.config import Config
from megatron_dapo.types import TrainBatch

VOCAB = 200
GRAD_CLIP = 1.0
UPDATES = 4
"""Optimizer updates per model in a "train" run (the first one's gradients are kept too)."""
LR, ADAM_EPS = 2e-4, 1e-6
"""A small step keeps the gradient norm above GRAD_CLIP for all UPDATES (PPO's ratio clip would zero
the gradient of tokens a large step moved), and an eps near the size of the clipped gradients makes
Adam's step depend on their scale: a wrong clip coefficient changes the parameters, and Adam does not
blow fp32 noise in ~1e-8 gradients up to a full lr step."""


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
    # large enough that the gradient norm stays above GRAD_CLIP for all UPDATES: clipping acts every time
    adv = 4 * torch.tensor([1.5, -0.5, -0.5, -0.5, 1.0, -1.0, 0.3, -0.3])
    return TrainBatch(input_ids=ids, loss_mask=mask, advantages=adv, lengths=lengths)


def old_logprob_offset(batch: TrainBatch) -> torch.Tensor:
    """pi_old != pi_theta so that both clip bounds are exercised (a fixed pattern over the FULL batch)."""
    return 0.3 * torch.sin(torch.arange(batch.input_ids.numel()).view_as(batch.input_ids) * 1.7)


def make_cfg(tp: int, pp: int) -> Config:
    cfg = Config()
    cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel = tp, pp
    cfg.model.dtype = os.environ.get("DAPO_TEST_DTYPE", "float32")  # type: ignore[assignment]
    cfg.actor.optimizer.lr, cfg.actor.optimizer.warmup_steps, cfg.actor.optimizer.adam_eps = LR, 0, ADAM_EPS
    cfg.actor.optimizer.grad_clip, cfg.actor.optimizer.weight_decay = GRAD_CLIP, 0.0
    cfg.actor.micro_batch_tokens = 48  # several micro-batches per mini-batch
    cfg.actor.logprob_micro_batch_tokens = 40
    cfg.actor.optimizer.distributed_optimizer = os.environ.get("DAPO_TEST_DISTOPT") == "1"
    cfg.parallel.sequence_parallel = os.environ.get("DAPO_TEST_SP") == "1"
    return cfg


def dp_rows(batch: TrainBatch) -> TrainBatch:
    from megatron_dapo.actor.batching import split_rows

    return split_rows(batch, parallel.dp_size())[parallel.dp_rank()]


def hf_tensors(actor: Actor, grads: bool = False) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in export_hf_weights(actor.module, actor.spec, grads=grads)}


def run_model(case: str, hf_dir: str, cfg: Config, ckpt: str | None) -> dict:
    actor = Actor.from_hf(hf_dir, cfg.model, cfg.parallel, cfg.actor)
    result: dict = {}
    batch = fixed_batch()
    batch.old_logprobs = actor.compute_logprobs(batch)[0] + old_logprob_offset(batch)
    mine = dp_rows(batch)
    if case == "load":
        load_checkpoint(actor, latest_checkpoint(ckpt))
    result["logprobs"], result["entropy"] = actor.compute_logprobs(batch)
    if case == "train":
        result["metrics"] = actor.train_step(mine)
        result["grads"], result["params"] = hf_tensors(actor, grads=True), hf_tensors(actor)
        result["logprobs_after"] = actor.compute_logprobs(batch)[0]
        if ckpt:
            save_checkpoint(actor, ckpt, step=1)
    if case in ("train", "load"):
        later = [actor.train_step(mine) for _ in range(UPDATES - 1)]
        result["next_losses"] = [m["loss"] for m in later]
    if case == "train":
        result["history"] = [result["metrics"], *later]
        result["params_final"] = hf_tensors(actor)
    if case == "nan":
        before = hf_tensors(actor)
        mine.advantages[0] = float("nan")
        result["metrics"] = actor.train_step(mine)
        after = dict(export_hf_weights(actor.module, actor.spec))
        result["unchanged"] = all(torch.equal(before[n], after[n]) for n in before)
        mine.advantages[0] = 1.0
        result["metrics_next"] = actor.train_step(mine)
    if case == "learn":
        result["losses"] = [actor.train_step(batch)["loss"] for _ in range(8)]
    return result


def run(case: str, hf_dirs: list[str], out: str, tp: int, pp: int, ckpt: str | None = None) -> None:
    cfg = make_cfg(tp, pp)
    parallel.initialize(cfg.parallel, seed=7)
    result: dict = {"rank": parallel.global_rank(), "dp_rank": parallel.dp_rank(), "models": {}}
    for i, hf_dir in enumerate(hf_dirs):
        result["models"][Path(hf_dir).name] = run_model(case, hf_dir, cfg, ckpt if i == 0 else None)
    torch.save(result, f"{out}/rank_{parallel.global_rank()}.pt")


TEST_ENV = ("DAPO_TEST_DTYPE", "DAPO_TEST_DISTOPT", "DAPO_TEST_SP")


def run_plan(path: str, run_one) -> None:
    """Each run of the plan in turn (run_one(entry)), in this process group: its own DAPO_TEST_* variables and
    fresh model-parallel groups."""
    from megatron.core import parallel_state as ps

    for entry in json.loads(Path(path).read_text()):
        for name in TEST_ENV:
            os.environ.pop(name, None)
        os.environ.update(entry.get("env", {}))
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        run_one(entry)
    parallel.destroy()


def main() -> None:
    assert sys.argv[1] == "plan", __doc__
    run_plan(sys.argv[2], lambda e: run(e["case"], e["hf_dirs"], e["out"], e["tp"], e["pp"], e.get("ckpt")))


if __name__ == "__main__":
    main()
