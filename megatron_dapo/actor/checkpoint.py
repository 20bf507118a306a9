"""Atomic, reshardable actor checkpoints with megatron.core.dist_checkpointing.

Layout of one checkpoint `<root>/step_<N>/`: the dist checkpoint (model + optimizer, loadable at any
TP/PP), `trainer_state.pt` (scheduler, update count and whatever the trainer adds, saved by rank 0),
`rng/rank_<r>.pt` (every rank's RNG states) and `COMPLETE` (written last). A save goes to
`step_<N>.tmp/` and is renamed when complete, so a crash never damages the latest good checkpoint.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_dapo import parallel
from megatron_dapo.hf_files import copy_aux_files

_STEP_DIR = re.compile(r"^step_(\d+)$")
# Reshardable distributed-optimizer state: saved per parameter in model space, not per DP rank.
_OPT_METADATA = {"distrib_optim_sharding_type": "fully_sharded_model_space"}


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root` (incomplete and .tmp folders are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / "COMPLETE").is_file()]
    return max(done, key=lambda p: int(_STEP_DIR.match(p.name).group(1)), default=None)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _sharded_state(actor: Any, is_loading: bool, with_optimizer: bool = True) -> dict:
    model_sd = actor.module.sharded_state_dict()
    if not with_optimizer:
        return {"model": model_sd}
    return {"model": model_sd,
            "optimizer": actor.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_OPT_METADATA)}


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(actor: Any, root: str | Path, step: int, trainer_state: dict | None = None,
                    keep_last: int = 3, hf_dir: str | Path | None = None) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint path.

    With `hf_dir`, its config.json and auxiliary files (tokenizer, chat template, generation config) are
    copied into `<ckpt>/hf/`, so the checkpoint converts back to Hugging Face format without extra flags."""
    from megatron.core import dist_checkpointing

    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if parallel.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    dist_checkpointing.save(_sharded_state(actor, is_loading=False), str(tmp))
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(rng_state(), tmp / "rng" / f"rank_{parallel.global_rank()}.pt")
    if parallel.is_main():
        state = {"scheduler": actor.scheduler.state_dict(), "updates": actor.updates, "step": step,
                 "trainer": trainer_state or {}}
        torch.save(state, tmp / "trainer_state.pt")
        if hf_dir is not None:
            copy_aux_files(hf_dir, tmp / "hf", with_config=True)
    _barrier()
    if parallel.is_main():
        (tmp / "COMPLETE").write_text(str(step))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        _prune(Path(root), keep_last)
    _barrier()
    return final


def _prune(root: Path, keep_last: int) -> None:
    done = sorted((p for p in root.iterdir() if _STEP_DIR.match(p.name)), key=lambda p: p.name)
    for old in done[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(actor: Any, path: str | Path, *, load_optimizer: bool = True, load_rng: bool = True) -> dict:
    """Collective. Loads model (+ optimizer, scheduler, RNG) at this run's TP/PP; returns the trainer state."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not (path / "COMPLETE").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no COMPLETE marker)")
    sharded = _sharded_state(actor, is_loading=True, with_optimizer=load_optimizer)
    state = dist_checkpointing.load(sharded, str(path))
    actor.module.load_state_dict(state["model"])
    state_file = path / "trainer_state.pt"
    extra = torch.load(state_file, weights_only=False) if state_file.is_file() else {}
    if load_optimizer:
        if not extra:
            raise FileNotFoundError(f"{path}: no trainer_state.pt (a weights-only checkpoint?): "
                                    "load it with load_optimizer=False")
        actor.optimizer.load_state_dict(state["optimizer"])
        actor.scheduler.load_state_dict(extra["scheduler"])
        actor.updates = extra["updates"]
    rng_file = path / "rng" / f"rank_{parallel.global_rank()}.pt"
    if load_rng and rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return extra
