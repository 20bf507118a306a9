"""Run by tests/test_phases_gpu.py on a CUDA machine: the phase ledger beside torch.cuda.memory_allocated.

    python tests/workers/phases_gpu_worker.py HF_DIR OUT_JSON

A bf16 Megatron actor and an in-process engine share one GPU; after each phase change the JSON holds
torch's allocated bytes and the ledger. A file, not a string in the test, so the type check reads it.
"""

import json
import sys

import torch

from megatron_dapo import parallel
from megatron_dapo.actor.actor import Actor
from megatron_dapo.config import Config
from megatron_dapo.loop.phases import Phases
from megatron_dapo.rollout.embedded import EmbeddedEngine
from megatron_dapo.types import TrainBatch


def main(hf_dir: str, out: str) -> None:
    cfg = Config()
    cfg.model.dtype, cfg.model.transformer_impl = "bfloat16", "local"
    parallel.initialize(cfg.parallel, seed=0)
    actor = Actor.from_hf(hf_dir, cfg.model, cfg.parallel, cfg.actor)
    engine = EmbeddedEngine(hf_dir, device="cuda", dtype=torch.bfloat16)
    phases = Phases(actor, engine, colocate=True, offload_when_idle=True)
    ids = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(0))
    batch = TrainBatch(input_ids=ids, loss_mask=torch.ones(2, 64), lengths=torch.full((2,), 64),
                       advantages=torch.tensor([1.0, -1.0]))
    phases.train()
    batch.old_logprobs = actor.compute_logprobs(batch)[0]
    actor.train_step(batch)  # the optimizer state exists from here on
    before = actor.compute_logprobs(batch)[0]
    res: dict[str, object] = {}
    for name, move in (("generate", phases.generate), ("train", phases.train), ("sync", lambda: phases.sync(1))):
        move()
        torch.cuda.synchronize()
        res[name] = {"allocated": torch.cuda.memory_allocated(), **phases.ledger}
    phases.train()
    res["logprobs_after_round_trip"] = (actor.compute_logprobs(batch)[0] - before).abs().max().item()
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
