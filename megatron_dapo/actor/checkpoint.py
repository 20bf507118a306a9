"""Atomic, verified, reshardable actor checkpoints with megatron.core.dist_checkpointing.

Layout of one checkpoint `<root>/step_<N>/`: the dist checkpoint (model + optimizer, loadable at any
TP/PP), `trainer_state.json` (scheduler, update count and whatever the trainer adds), `rng/rank_<r>.safetensors`
(every rank's RNG states), `manifest.json` (size and sha256 of every file) and `COMPLETE` (written last;
see checkpoint_files.py). A save goes to `step_<N>.tmp/` and is renamed when complete, with SIGINT /
SIGTERM / SIGUSR1 held back during that commit, so neither a crash nor Ctrl-C damages the latest good
checkpoint. Weights that are not finite are never saved. A checkpoint is verified against its manifest
before it is loaded; `newest_verified` falls back past the ones that do not verify.
"""

from __future__ import annotations

import logging
import re
import shutil
import signal
import threading
import types
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_dapo import parallel
from megatron_dapo.actor import checkpoint_files as files
from megatron_dapo.actor.actor import NonFiniteWeightsError
from megatron_dapo.actor.checkpoint_files import CheckpointError
from megatron_dapo.hf_files import copy_aux_files

__all__ = ["CheckpointError", "checkpoints", "latest_checkpoint", "load_checkpoint", "newest_verified",
           "save_checkpoint", "step_dir", "step_of"]

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Reshardable distributed-optimizer state: saved per parameter in model space, not per DP rank.
_OPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}  # (megatron-core 0.16: model_space is broken)
_HELD_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGUSR1}


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def step_of(path: Path) -> int | None:
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def checkpoints(root: str | Path) -> list[Path]:
    """Every `step_<N>` folder under `root` (complete or not), oldest step first."""
    root = Path(root)
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None] if root.is_dir() else []
    return sorted(found, key=step_of)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root` (incomplete and .tmp folders are ignored); unverified."""
    done = [p for p in checkpoints(root) if (p / files.COMPLETE).is_file()]
    return done[-1] if done else None


def newest_verified(root: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """Collective: the newest checkpoint under `root` that verifies against its manifest, and the newer
    ones skipped with the reason each failed."""
    skipped: list[tuple[Path, str]] = []
    for path in reversed(checkpoints(root)):
        problem = files.verify(path)
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
    return None, skipped


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _sharded_state(actor: Any, is_loading: bool, with_optimizer: bool = True) -> dict:
    model_sd = actor.module.sharded_state_dict()
    if not with_optimizer:
        return {"model": model_sd}
    return {"model": model_sd,
            "optimizer": actor.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_OPT_METADATA)}


def _materialize_optimizer_state(optimizer: Any) -> None:
    """Adam creates its state at the first step. A checkpoint saved before any update (every group
    filtered out so far) would hold no moments, and loading it fails (the loader expects them); the
    distributed optimizer cannot even save an empty state. Create the zeros and step count the first
    step would create, which changes no number."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = sub.optimizer
        empty = {id(p) for g in inner.param_groups for p in g["params"] if not inner.state[p]}
        if not empty:
            continue
        sub.init_state_fn(inner, sub.config)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            for group in inner.param_groups:
                for p in group["params"]:
                    if id(p) in empty and "step" not in inner.state[p]:
                        on_device = group.get("capturable") or group.get("fused")
                        inner.state[p]["step"] = (torch.zeros((), dtype=torch.float32, device=p.device)
                                                  if on_device else torch.tensor(0.0))


def _restore_zero_steps(sd: Any) -> None:
    """Megatron saves Adam's shared step count only when it is non-zero (`if step:`): give the moments
    of a checkpoint saved before the first update their step 0 back, as the first step would."""
    if not isinstance(sd, dict):
        return
    for param_state in (sd.get("state") or {}).values() if isinstance(sd.get("state"), dict) else ():
        if isinstance(param_state, dict) and "exp_avg" in param_state and "step" not in param_state:
            param_state["step"] = torch.tensor(0.0)
    for value in sd.values():
        _restore_zero_steps(value)


def load_sharded(sharded: dict, path: Path, expected: Iterable[str]) -> dict:
    """dist_checkpointing.load, tolerating only absent `_extra_state` entries: Transformer Engine's modules
    ask for them (FP8 metadata) and a checkpoint written with the local spec (the converter's, a CPU run's)
    has none; they load as None, which TE's set_extra_state takes as "nothing saved". Any other tensor the
    model needs and the checkpoint lacks is a CheckpointError naming it."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    state, _, unexpected = dist_checkpointing.load(sharded, str(path), strict=StrictHandling.RETURN_UNEXPECTED)
    absent = sorted(k for k in unexpected if "_extra_state" not in k)
    if absent:
        raise CheckpointError(f"checkpoint {path} lacks {len(absent)} tensor(s) this model needs, e.g. "
                              f"{', '.join(absent[:3])} (another architecture or layer spec?)")
    for key in expected:
        if key.endswith("._extra_state") and key not in state["model"]:
            state["model"][key] = None
    return state


def _keep_adam_steps(optimizer: Any) -> None:
    """megatron-core 0.16.1's distributed optimizer, with torch's Adam (no TE / apex), loads a
    fully-reshardable state by copying every key of Adam's per-parameter state from the checkpoint's
    tensors, which never hold "step" (restored beforehand from the param groups): KeyError 'step', so no
    run with actor.optimizer.distributed_optimizer could resume. Keep the step it already restored."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    def set_states(self: Any, model_param: Any, tensors: dict) -> None:
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group, order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
            if "step" in state:
                tensors = {**tensors, "step": state["step"].clone()}
        DistributedOptimizer._set_main_param_and_optimizer_states(self, model_param, tensors)

    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(sub, DistributedOptimizer):
            sub._set_main_param_and_optimizer_states = types.MethodType(set_states, sub)


def _unshare_adam_steps(optimizer: Any) -> None:
    """The distributed optimizer restores Adam's step count as ONE tensor shared by every parameter's state;
    torch's Adam increments each parameter's step in place, so after a resume the shared count ran ahead by
    the number of parameters per update, and the bias correction with it. Give each its own."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in sub.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


@contextmanager
def _signals_held() -> Iterator[None]:
    """Hold back Ctrl-C and preemption signals (delivered right after) while a checkpoint is committed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _in_process_write_results() -> None:
    """megatron-core's torch_dist writer returns its write results through a queue it makes at a process's first
    save: a multiprocessing Manager's, started with spawn, i.e. a fresh interpreter that imports the trainer's
    main module (about 5 s of CPU in every run that saves, measured on CPU). A synchronous save, ours
    (dist_checkpointing.save), puts the results and reads them in this process, so a thread-safe queue does."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save_checkpoint(actor: Any, root: str | Path, step: int, trainer_state: dict | None = None,
                    keep_last: int = 3, hf_dir: str | Path | None = None) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint path.

    `trainer_state` must be JSON-serialisable but for tensors (kept in a safetensors file beside it). With
    `hf_dir`, its config.json and auxiliary files (tokenizer, chat template, generation config) are copied into
    `<ckpt>/hf/`, so the checkpoint converts back to Hugging Face format without extra flags. Raises NonFiniteWeightsError (nothing
    written) if any rank's weights hold inf or NaN."""
    from megatron.core import dist_checkpointing

    if not actor.weights_finite():
        raise NonFiniteWeightsError(f"step {step}: the weights hold inf or NaN; not saving them (the last "
                                    f"complete checkpoint under {root} is intact)")
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if parallel.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    _materialize_optimizer_state(actor.optimizer)
    _in_process_write_results()
    dist_checkpointing.save(_sharded_state(actor, is_loading=False), str(tmp))
    (tmp / "rng").mkdir(exist_ok=True)
    files.save_rng(tmp / "rng" / f"rank_{parallel.global_rank()}.safetensors")
    if parallel.is_main():
        state = {"format": files.FORMAT, "step": step, "updates": actor.updates,
                 "scheduler": actor.scheduler.state_dict(), "trainer": trainer_state or {}}
        files.write_state(tmp, state)
        if hf_dir is not None:
            copy_aux_files(hf_dir, tmp / "hf", with_config=True)
    _barrier()
    files.write_manifest(tmp)
    if parallel.is_main():
        with _signals_held():
            files.write_json(tmp / files.COMPLETE, step)
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            _prune(Path(root), keep_last, step)
    _barrier()
    return final


def _prune(root: Path, keep_last: int, step: int) -> None:
    """Keep the `keep_last` newest checkpoints up to `step` (the one just written among them)."""
    mine = [p for p in checkpoints(root) if step_of(p) <= step]
    for old in mine[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(actor: Any, path: str | Path, *, load_optimizer: bool = True, load_rng: bool = True,
                    verify: bool = True) -> dict:
    """Collective. Loads model (+ optimizer, scheduler, RNG) at this run's TP/PP; returns the trainer state.

    The checkpoint is verified against its manifest first (`verify=False`: the caller just did);
    CheckpointError names the checkpoint and the problem."""
    path = Path(path)
    problem = files.verify(path) if verify else None
    if problem is not None:
        raise CheckpointError(f"checkpoint {path}: {problem}")
    extra = files.read_state(path)
    if load_optimizer and not extra:
        raise CheckpointError(f"checkpoint {path}: no {files.STATE_FILE} (a weights-only checkpoint?): load it "
                              "with load_optimizer=False")
    if load_optimizer:  # a fresh optimizer has no state yet: the distributed one cannot describe it
        _materialize_optimizer_state(actor.optimizer)
    sharded = _sharded_state(actor, is_loading=True, with_optimizer=load_optimizer)
    state = load_sharded(sharded, path, expected=actor.module.state_dict().keys())
    actor.module.load_state_dict(state["model"])
    if not load_optimizer:
        actor.weights_loaded()
    else:
        _restore_zero_steps(state["optimizer"])
        _keep_adam_steps(actor.optimizer)
        actor.optimizer.load_state_dict(state["optimizer"])
        _unshare_adam_steps(actor.optimizer)
        actor.scheduler.load_state_dict(extra["scheduler"])
        actor.updates = extra["updates"]
    rng_file = path / "rng" / f"rank_{parallel.global_rank()}.safetensors"
    if load_rng and rng_file.is_file():
        files.load_rng(rng_file)
    return extra
