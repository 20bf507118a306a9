"""What a checkpoint folder holds besides the dist checkpoint, and how it is verified before use.

    manifest.json              every other file: size and sha256 (written before COMPLETE)
    trainer_state.json         scheduler, update count, step and the trainer's state: plain JSON
    trainer_tensors.safetensors  the tensors of the trainer's state (e.g. samples' routes), each named in the JSON
                               by {"__tensor__": name}; absent when it holds none
    rng/rank_<r>.safetensors   each rank's RNG states: tensors, python/numpy states as JSON metadata

Nothing here unpickles: a crafted file cannot run code through these readers. (torch's own
distributed-checkpoint `.metadata` is a pickle that dist_checkpointing reads: checkpoints are trusted
input, and the manifest is verified before that file is opened.) Hashing is shared among the ranks:
rank r hashes every world-th file.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

MANIFEST = "manifest.json"
STATE_FILE = "trainer_state.json"
TENSORS_FILE = "trainer_tensors.safetensors"
_TENSOR = "__tensor__"
COMPLETE = "COMPLETE"
FORMAT = 2
_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted or read; the message names it and says why, on one line."""


def _share() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(obj: Any) -> list[Any]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def listed_files(folder: Path) -> list[str]:
    """Every file under `folder` except the manifest and the COMPLETE marker (relative, sorted)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and p.name not in (MANIFEST, COMPLETE))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: Path, *, collective: bool = True) -> None:
    """Hash every file of `folder`; rank 0 writes manifest.json. Collective (the ranks share the hashing)
    unless `collective=False` (one process hashes them all)."""
    rank, world = _share() if collective else (0, 1)
    files = listed_files(folder)
    mine = {f: {"size": (folder / f).stat().st_size, "sha256": sha256(folder / f)} for f in files[rank::world]}
    entries: dict[str, Any] = {}
    for part in _gather(mine) if collective else [mine]:
        entries.update(part)
    if rank == 0:
        write_json(folder / MANIFEST, {"format": FORMAT, "files": dict(sorted(entries.items()))})


def write_json(path: Path, obj: Any) -> None:
    """Write JSON and fsync it: a later COMPLETE marker must never precede its content on disk."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _header_problem(folder: Path) -> tuple[str | None, dict]:
    if not (folder / COMPLETE).is_file():
        return "incomplete (no COMPLETE marker)", {}
    if not (folder / MANIFEST).is_file():
        if (folder / "trainer_state.pt").is_file():
            return ("written by an older megatron-dapo (pickled trainer_state.pt, no manifest.json); it is not "
                    "loaded, since unpickling a file can run code: start a fresh run or resume from a newer "
                    "checkpoint"), {}
        return ("no manifest.json, so it cannot be verified (saved or converted by an older megatron-dapo? "
                "convert it again)"), {}
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        return f"unreadable {MANIFEST} ({type(e).__name__})", {}
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or manifest.get("format") != FORMAT or not all(
            isinstance(v, dict) for v in files.values()):
        return f"{MANIFEST} is not a format-{FORMAT} manifest", {}
    return None, files


def _file_problem(folder: Path, name: str, want: dict) -> str | None:
    path = folder / name
    if not path.is_file():
        return f"{name} is missing"
    size = path.stat().st_size
    if size != want.get("size"):
        return f"{name} has {size} bytes, the manifest says {want.get('size')}"
    if sha256(path) != want.get("sha256"):
        return f"{name} does not match its checksum"
    return None


def verify(folder: str | Path) -> str | None:
    """Collective: None if `folder` is a complete checkpoint whose files all match its manifest, else
    the first problem found (a file missing, truncated, changed; no manifest; an old format)."""
    folder = Path(folder)
    problem, files = _header_problem(folder)
    if problem is None:
        rank, world = _share()
        mine = [p for name in sorted(files)[rank::world] if (p := _file_problem(folder, name, files[name]))]
        problem = next((p for part in _gather(mine) for p in part), None)
    return problem


# --- trainer state and RNG: no pickle --------------------------------------------------------------


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None


def split_tensors(obj: Any, out: dict[str, torch.Tensor] | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """`obj` (dicts, lists, tuples, scalars and tensors) as plain JSON, each tensor replaced by {"__tensor__": name},
    and the tensors by name (for TENSORS_FILE)."""
    out = {} if out is None else out
    if isinstance(obj, torch.Tensor):
        name = f"t{len(out)}"
        out[name] = obj.detach().to("cpu").contiguous()
        return {_TENSOR: name}, out
    if isinstance(obj, dict):
        return {k: split_tensors(v, out)[0] for k, v in obj.items()}, out
    if isinstance(obj, (list, tuple)):
        return [split_tensors(v, out)[0] for v in obj], out
    return obj, out


def join_tensors(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """split_tensors' inverse (tuples come back as lists, as from JSON)."""
    if isinstance(obj, dict):
        if set(obj) == {_TENSOR}:
            if obj[_TENSOR] not in tensors:
                raise CheckpointError(f"{TENSORS_FILE} lacks the tensor {obj[_TENSOR]!r} the trainer state names")
            return tensors[obj[_TENSOR]]
        return {k: join_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [join_tensors(v, tensors) for v in obj]
    return obj


def write_state(folder: Path, state: dict) -> None:
    """trainer_state.json, and TENSORS_FILE for the tensors it holds."""
    from safetensors.torch import save_file

    plain, tensors = split_tensors(state)
    write_json(folder / STATE_FILE, plain)
    if tensors:
        save_file(tensors, str(folder / TENSORS_FILE))


def read_state(folder: Path) -> dict:
    """write_state's state ({} where the folder has no trainer_state.json)."""
    from safetensors.torch import load_file

    if not (folder / STATE_FILE).is_file():
        return {}
    state = read_json(folder / STATE_FILE)
    tensors = folder / TENSORS_FILE
    return join_tensors(state, load_file(str(tensors)) if tensors.is_file() else {})


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_rng(path: Path) -> None:
    """This process's RNG states as safetensors (tensors) + JSON metadata (python's and numpy's scalars)."""
    from safetensors.torch import save_file

    state = rng_state()
    version, internal, gauss = state["python"]
    name, keys, pos, has_gauss, cached = state["numpy"]
    tensors = {"python": torch.tensor(internal, dtype=torch.int64), "numpy": torch.from_numpy(keys.astype(np.int64)),
               "torch": state["torch"]}
    for i, s in enumerate(state["cuda"] or []):
        tensors[f"cuda.{i}"] = s
    meta = {"python": json.dumps([version, gauss]), "numpy": json.dumps([name, int(pos), int(has_gauss), float(cached)])}
    save_file(tensors, str(path), metadata=meta)


def load_rng(path: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        t = {k: f.get_tensor(k) for k in f.keys()}
    version, gauss = json.loads(meta["python"])
    name, pos, has_gauss, cached = json.loads(meta["numpy"])
    cuda = [t[k] for k in sorted((k for k in t if k.startswith("cuda.")), key=lambda k: int(k[5:]))]
    set_rng_state({"python": (version, tuple(t["python"].tolist()), gauss),
                   "numpy": (name, t["numpy"].numpy().astype(np.uint32), pos, has_gauss, cached),
                   "torch": t["torch"], "cuda": cuda or None})
