"""Run under torchrun by tests/test_qwen3_moe.py and tests/test_routing_replay.py: Qwen3 / MoE models at
TP x PP x EP layouts.

    torchrun --nproc_per_node N tests/workers/moe_worker.py plan PLAN_JSON

The plan: runs of this world size in one launch (actor_worker.run_plan; entries case, hf_dirs, out, tp, pp, ep), each
at its TP x PP x EP layout.

CASE "logits": load each HF folder into a model built to be loaded, save the logits of the conversion
tool's fixed verification batch and whether exporting gives back every HF tensor bit for bit.
CASE "train": the actor's DAPO updates of tests/workers/actor_worker.py (clipping on, several updates).
CASE "uneven": the EP ranks' rows pack into different numbers of micro-batches (4 and 2): the pi_old pass of each
rank's own rows and one update, with the packed counts.
CASE "replay": actor.routing_replay=r2, one update of the batch (routes included) saved in $REPLAY_BATCH, this
rank's rows and this stage's MoE layers of its routes; then routing_replay=r3 on a fresh actor, the batch's routes
of every layer replayed in the pi_old pass and the update.
CASE "checkpoint": HF_DIRs are converted checkpoints: the actor loads each (load_checkpoint, weights only),
saves the verification logits and exports it with save_hf_checkpoint to OUT_DIR/<name>_export.
"""

import sys
from pathlib import Path

import torch
from actor_worker import dp_rows, fixed_batch, hf_tensors, make_cfg, old_logprob_offset, run_model, run_plan

from megatron_dapo import parallel
from megatron_dapo.actor.actor import Actor
from megatron_dapo.actor.batching import micro_batches, select_rows
from megatron_dapo.actor.checkpoint import load_checkpoint
from megatron_dapo.actor.convert_checks import HF_SUBDIR
from megatron_dapo.actor.convert_verify import megatron_logits, verify_tokens
from megatron_dapo.actor.hf_io import export_hf_weights, load_hf_weights, save_hf_checkpoint
from megatron_dapo.actor.model import build_model, load_hf_config, spec_from_hf
from megatron_dapo.hf_files import SafetensorsReader


def logits_and_export(hf_dir: str, cfg) -> dict:
    spec = spec_from_hf(load_hf_config(hf_dir))
    model = build_model(spec, cfg.model, cfg.parallel, init_weights=False)
    reader = SafetensorsReader(hf_dir)
    load_hf_weights(model, reader, spec)
    logits = megatron_logits(model, verify_tokens(spec), spec.vocab_size)
    exported = {name: t.clone() for name, t in export_hf_weights(model, spec)}
    identical = {name: bool(torch.equal(t, reader.get(name))) for name, t in exported.items()}
    return {"logits": logits, "identical": identical, "last_stage": parallel.is_last_stage()}


def from_checkpoint(ckpt: str, cfg, out: str) -> dict:
    spec = spec_from_hf(load_hf_config(Path(ckpt) / HF_SUBDIR))
    actor = Actor(spec, cfg.model, cfg.parallel, cfg.actor)  # random init, then overwritten
    load_checkpoint(actor, ckpt, load_optimizer=False)
    logits = megatron_logits(actor.module, verify_tokens(spec), spec.vocab_size)
    save_hf_checkpoint(actor.module, spec, Path(out) / f"{Path(ckpt).name}_export", Path(ckpt) / HF_SUBDIR)
    return {"logits": logits, "last_stage": parallel.is_last_stage()}


UNEVEN_ORDER = [0, 3, 5, 7, 1, 2, 6, 4]
"""fixed_batch's rows, longest first: the first DP rank's are 16, 16, 13, 12 tokens, the second's 11, 9, 8, 6."""
UNEVEN_BUDGET = 20
"""Tokens per micro-batch: 4 micro-batches of the first rank's rows, 2 of the second's."""


def uneven(hf_dir: str, cfg) -> dict:
    cfg.actor.micro_batch_tokens = cfg.actor.logprob_micro_batch_tokens = UNEVEN_BUDGET
    actor = Actor.from_hf(hf_dir, cfg.model, cfg.parallel, cfg.actor)
    batch = select_rows(fixed_batch(), torch.tensor(UNEVEN_ORDER))
    batch.old_logprobs = actor.compute_logprobs(batch)[0] + old_logprob_offset(batch)
    mine = dp_rows(batch)
    packed = len(micro_batches(mine, UNEVEN_BUDGET, thd=actor.thd))
    logprobs = actor.compute_logprobs(mine)[0]
    metrics = actor.train_step(mine)
    return {"packed": packed, "logprobs": logprobs, "metrics": metrics, "grads": hf_tensors(actor, grads=True)}


def replay(hf_dir: str, cfg, mode: str = "r2") -> dict:
    """r2: the update replays this stage's layers of the batch's routes. r3: the batch holds routes of every layer,
    as a rollout returns them; the pi_old pass (all rows) and the update replay them (the actor takes its stage's)."""
    import os

    cfg.actor.routing_replay = mode
    cfg.actor.micro_batch_tokens = 24
    actor = Actor.from_hf(hf_dir, cfg.model, cfg.parallel, cfg.actor)
    batch = torch.load(os.environ["REPLAY_BATCH"], weights_only=False)
    out = {}
    if mode == "r2":
        layers = batch.routes.shape[2] // parallel.pp_size()
        batch.routes = batch.routes[:, :, parallel.pp_rank() * layers:(parallel.pp_rank() + 1) * layers]
    else:
        out["old_logprobs"] = actor.compute_logprobs(batch, record_routes=True)[0]
    return {**out, "metrics": actor.train_step(dp_rows(batch))}


def main() -> None:
    assert sys.argv[1] == "plan", __doc__
    run_plan(sys.argv[2], lambda e: run(e["case"], e["hf_dirs"], e["out"], e["tp"], e["pp"], e["ep"]))


def run(case: str, hf_dirs: list[str], out: str, tp: int, pp: int, ep: int) -> None:
    cfg = make_cfg(tp, pp)
    cfg.parallel.expert_parallel = ep
    parallel.initialize(cfg.parallel, seed=7)
    result: dict = {"rank": parallel.global_rank(), "ep_rank": parallel.ep_rank(), "models": {}}
    for hf_dir in hf_dirs:
        name = Path(hf_dir).name
        if case == "logits":
            result["models"][name] = logits_and_export(hf_dir, cfg)
        elif case == "replay":
            result["models"][name] = {mode: replay(hf_dir, cfg, mode) for mode in ("r2", "r3")}
        elif case == "uneven":
            result["models"][name] = uneven(hf_dir, cfg)
        elif case == "checkpoint":
            result["models"][name] = from_checkpoint(hf_dir, cfg, out)
        else:
            result["models"][name] = run_model("train", hf_dir, cfg, None)
    torch.save(result, f"{out}/rank_{parallel.global_rank()}.pt")


if __name__ == "__main__":
    main()
