"""Run under torchrun by tests/test_checkpoint_safety.py: checkpoint cases on a real actor.

    torchrun --nproc_per_node N tests/workers/checkpoint_worker.py CASE HF_DIR OUT_DIR

empty_opt: save before the optimizer ever stepped, load into a fresh actor, train: the same loss and
           weights as an actor that never saved (the lead's KeyError "optimizer.state.exp_avg...").
poison:    an infinite learning rate: the update stops with NonFiniteWeightsError and no checkpoint
           of the poisoned weights is written.
format:    a saved checkpoint holds no pickle of ours; a crafted pickle next to / instead of the
           trainer state is never unpickled.
te_extra_state: a model whose sharded state dict asks for Transformer Engine's `_extra_state` objects loads
           a checkpoint written with the local spec (which has none).
"""

import os
import pickle
import sys
from pathlib import Path

import torch
from actor_worker import dp_rows, fixed_batch, make_cfg

from megatron_dapo import parallel
from megatron_dapo.actor.actor import Actor
from megatron_dapo.actor.checkpoint import load_checkpoint, save_checkpoint, step_dir
from megatron_dapo.actor.hf_io import export_hf_weights


class Payload:
    """Unpickling this creates the file `path`: proof that a load ran code."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def params(actor):
    return {n: t.clone() for n, t in export_hf_weights(actor.module, actor.spec)}


def train_once(actor, batch):
    batch.old_logprobs = actor.compute_logprobs(batch)[0] + 0.1
    return actor.train_step(dp_rows(batch))


def main() -> None:
    case, hf_dir, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    cfg = make_cfg(1, 1)
    if case == "poison":
        cfg.actor.optimizer.lr = float("inf")
    parallel.initialize(cfg.parallel, seed=7)
    result: dict = {}
    batch = fixed_batch()
    root = out / "ckpt"
    if case == "empty_opt":
        saved = Actor.from_hf(hf_dir, cfg.model, cfg.parallel, cfg.actor)
        path = save_checkpoint(saved, root, step=1, trainer_state={"note": "before any update"})
        resumed = Actor.from_hf(hf_dir, cfg.model, cfg.parallel, cfg.actor)
        result["extra"] = load_checkpoint(resumed, path)
        fresh = Actor.from_hf(hf_dir, cfg.model, cfg.parallel, cfg.actor)
        for name, actor in (("saved", saved), ("resumed", resumed), ("fresh", fresh)):
            result[name] = {"metrics": [train_once(actor, fixed_batch()) for _ in range(2)], "params": params(actor)}
    if case == "poison":
        from megatron_dapo.actor.actor import NonFiniteWeightsError

        actor = Actor.from_hf(hf_dir, cfg.model, cfg.parallel, cfg.actor)
        try:
            train_once(actor, batch)
            result["train_error"] = None
        except NonFiniteWeightsError as e:
            result["train_error"] = str(e)
        try:
            save_checkpoint(actor, root, step=1)
            result["save_error"] = None
        except NonFiniteWeightsError as e:
            result["save_error"] = str(e)
        result["written"] = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    if case == "format":
        from megatron_dapo.actor.checkpoint import CheckpointError

        actor = Actor.from_hf(hf_dir, cfg.model, cfg.parallel, cfg.actor)
        train_once(actor, batch)
        path = save_checkpoint(actor, root, step=1, trainer_state={"data": {"epoch": 0}})
        parallel_barrier()
        result["files"] = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
        marker = out / f"pwned_{parallel.global_rank()}"
        if parallel.is_main():  # a crafted pickle where the old format kept the RNG state
            (path / "rng" / "rank_0.pt").write_bytes(pickle.dumps({"x": Payload(str(marker))}))
        parallel_barrier()
        again = Actor.from_hf(hf_dir, cfg.model, cfg.parallel, cfg.actor)
        result["extra"] = load_checkpoint(again, path)
        result["same_params"] = all(torch.equal(a, b) for a, b in zip(params(actor).values(), params(again).values()))
        # an old-format checkpoint: a pickled trainer_state.pt and no manifest
        old = step_dir(root, 2)
        if parallel.is_main():
            os.rename(path, old)
            (old / "manifest.json").unlink()
            (old / "trainer_state.pt").write_bytes(pickle.dumps({"scheduler": Payload(str(marker))}))
        parallel_barrier()
        try:
            load_checkpoint(again, old)
            result["old_error"] = None
        except CheckpointError as e:
            result["old_error"] = str(e)
        result["pwned"] = marker.exists()
    if case == "te_extra_state":
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        actor = Actor.from_hf(hf_dir, cfg.model, cfg.parallel, cfg.actor)
        train_once(actor, batch)
        path = save_checkpoint(actor, root, step=1)  # the local spec: no _extra_state in the checkpoint
        te_like = Actor.from_hf(hf_dir, cfg.model, cfg.parallel, cfg.actor)
        local = te_like.module.sharded_state_dict

        def with_extra_state(*args, **kwargs):  # what Transformer Engine's linear / norm modules add
            sd = local(*args, **kwargs)
            for name in [k.removesuffix(".weight") for k in sd if k.endswith("linear_qkv.weight")]:
                key = f"{name}._extra_state"
                sd[key] = ShardedObject(key, None, (1,), (0,), replica_id=0)
            return sd

        te_like.module.sharded_state_dict = with_extra_state
        load_checkpoint(te_like, path)
        result["same_params"] = all(torch.equal(a, b) for a, b in zip(params(actor).values(),
                                                                       params(te_like).values()))
        result["extra_keys"] = sum(k.endswith("._extra_state") for k in with_extra_state())
    torch.save(result, out / f"rank_{parallel.global_rank()}.pt")
    parallel.destroy()


def parallel_barrier():
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


if __name__ == "__main__":
    main()
