"""The checks a conversion runs before anything heavy: inputs (config, tensor headers, checkpoint folders),
the output folder and its file system. Every failure is a one-line `UserError` (or
`HFCheckpointError` / `UnsupportedModelError`, see `USER_ERRORS`) naming the file and the field.

A converted checkpoint is a weights-only actor checkpoint (see megatron_dapo/actor/checkpoint.py):

    OUT/                 dist_checkpointing files of {"model": GPTModel.sharded_state_dict()}
    OUT/COMPLETE         written last; `load_checkpoint(actor, OUT, load_optimizer=False)` needs it
    OUT/hf/              the source's config.json, generation_config.json and tokenizer files
    OUT/conversion.json  source path, TP/PP/dtype it was written with, tensor count, bytes
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from megatron_dapo.actor.model import SUPPORTED_ARCHITECTURES, ModelSpec, UnsupportedModelError
from megatron_dapo.cli import UserError
from megatron_dapo.hf_files import HFCheckpointError, TensorInfo

USER_ERRORS = (UserError, HFCheckpointError, UnsupportedModelError)
"""What the conversion tools report as one line with exit code 2."""
EXIT_OK, EXIT_VERIFY_FAILED = 0, 1
HF_SUBDIR = "hf"
CONVERSION_FILE = "conversion.json"
# HF tensors that hold no weights of ours and may be dropped silently.
_IGNORABLE = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_ST_TO_DTYPE = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '100KB', '123' (bytes) -> bytes (decimal units like transformers)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    if not m:
        raise UserError(f"--max-shard-size {text!r}: expected a size like 5GB, 500MB, 2GiB or a byte count")
    value, unit = float(m.group(1)), m.group(2).rstrip("B")
    scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    size = int(value * scale)
    if size <= 0:
        raise UserError(f"--max-shard-size {text!r} must be positive")
    return size


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n} B"


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled, file=sys.stderr,
                dynamic_ncols=True, leave=False)


# --- Hugging Face side: config and safetensors headers, checked without loading tensors ------------


def read_hf_config(hf_dir: Path) -> tuple[Any, bytes]:
    """(transformers config, the exact bytes of config.json); unsupported architectures fail by name."""
    cfg_file = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():
        raise UserError(f"{hf_dir}: no such directory")
    if not cfg_file.is_file():
        raise UserError(f"{hf_dir}: no config.json (is this a Hugging Face model folder?)")
    raw = cfg_file.read_bytes()
    try:
        fields = json.loads(raw)
    except json.JSONDecodeError as e:
        raise UserError(f"{cfg_file}: not valid JSON ({e})") from e
    arch = (fields.get("architectures") or [None])[0]
    model_type = fields.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES and model_type not in SUPPORTED_ARCHITECTURES.values():
        raise UnsupportedModelError(f"{cfg_file}: architectures={arch!r} / model_type={model_type!r}: "
                                    f"supported are {sorted(SUPPORTED_ARCHITECTURES)}")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(hf_dir)), raw
    except Exception as e:  # transformers rejects inconsistent configs with assorted error types
        raise UserError(f"{cfg_file}: transformers cannot read it ({str(e).splitlines()[0]})") from e


def check_hf_tensors(table: dict[str, TensorInfo], spec: ModelSpec, hf_dir: Path) -> str:
    """Every tensor the config implies is there with the config's shape, nothing unknown is left over.

    Returns the common dtype name ('float32', 'bfloat16', 'float16' or 'mixed').
    """
    from megatron_dapo.actor.hf_mapping import expected_hf_shape, hf_names

    needed = hf_names(spec)
    missing = [n for n in needed if n not in table]
    if missing:
        raise UserError(f"{hf_dir}: tensor {missing[0]} is missing" +
                        (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "") +
                        f"; config.json says num_hidden_layers={spec.num_layers}, "
                        f"tie_word_embeddings={spec.tied_embeddings}, qkv bias={spec.qkv_bias}")
    for name in needed:
        file, dtype, shape = table[name]
        want = expected_hf_shape(name, spec)
        if shape != want:
            raise UserError(f"{name}: shape {list(shape)} in {file} does not match config.json (expected "
                            f"{list(want)}; hidden_size={spec.hidden_size}, "
                            f"intermediate_size={spec.ffn_hidden_size}, heads={spec.num_heads}, "
                            f"kv_heads={spec.num_kv_heads}, head_dim={spec.head_dim}, "
                            f"vocab_size={spec.vocab_size})")
        if dtype not in _ST_TO_DTYPE:
            raise UserError(f"{name}: dtype {dtype} in {file} is not a float type we convert "
                            "(F32, BF16, F16)")
    known = set(needed)
    extra = [n for n in table if n not in known and not _IGNORABLE.search(n)
             and not (n == "lm_head.weight" and spec.tied_embeddings)]
    if extra:
        raise UserError(f"{hf_dir}: {len(extra)} tensor(s) that config.json does not describe, e.g. "
                        f"{extra[0]} (a different architecture, or num_hidden_layers too small?)")
    dtypes = {_ST_TO_DTYPE[table[n].dtype] for n in needed}
    return dtypes.pop() if len(dtypes) == 1 else "mixed"


def hf_numel(table: dict[str, TensorInfo], spec: ModelSpec) -> int:
    """Elements of every tensor the model uses (for the size of what a conversion writes)."""
    from megatron_dapo.actor.hf_mapping import hf_names

    return sum(math.prod(table[n].shape) for n in hf_names(spec))


def spec_difference(a: ModelSpec, b: ModelSpec) -> list[str]:
    da, db = asdict(a), asdict(b)
    return [f"{k}: {da[k]} vs {db[k]}" for k in da if da[k] != db[k]]


# --- Megatron side: which checkpoint, and which config describes it ---------------------------------


def resolve_checkpoint(load: Path, flag: str = "--load") -> Path:
    """A complete checkpoint folder, or the latest complete step_<N>/ under `load` (given as `flag`)."""
    from megatron_dapo.actor.checkpoint import latest_checkpoint

    if not load.is_dir():
        raise UserError(f"{flag} {load}: no such folder")
    if (load / "COMPLETE").is_file():
        return load
    if (load / "metadata.json").is_file():
        raise UserError(f"{flag} {load}: incomplete checkpoint (no COMPLETE marker): an interrupted save?")
    if (load / "config.json").is_file() and any(load.glob("*.safetensors*")):
        raise UserError(f"{flag} {load} is a Hugging Face folder, not a Megatron checkpoint "
                        "(use convert_hf_to_megatron.py for that direction)")
    latest = latest_checkpoint(load)
    if latest is None:
        raise UserError(f"{flag} {load}: neither a checkpoint (no COMPLETE marker) nor a folder of "
                        "complete step_<N>/ checkpoints")
    return latest


def checkpoint_config(ckpt: Path, hf_dir: Path | None) -> tuple[ModelSpec, bytes, Path]:
    """(spec, config.json bytes, that file) of a checkpoint: its hf/ copy or `hf_dir`; both must agree."""
    from megatron_dapo.actor.model import spec_from_hf

    stored = ckpt / HF_SUBDIR
    have_stored = (stored / "config.json").is_file()
    if hf_dir is None and not have_stored:
        raise UserError(f"--load {ckpt} keeps no config.json (a training checkpoint?): pass --hf-dir "
                        "with the model's Hugging Face folder (config.json, tokenizer files)")
    source = hf_dir if hf_dir is not None else stored
    hf_config, raw = read_hf_config(source)
    spec = spec_from_hf(hf_config)
    if hf_dir is not None and have_stored:
        diff = spec_difference(spec_from_hf(read_hf_config(stored)[0]), spec)
        if diff:
            raise UserError(f"--hf-dir {hf_dir} describes a different model than the checkpoint's "
                            f"{stored / 'config.json'} ({'; '.join(diff)})")
    return spec, raw, source / "config.json"


# --- output folders ---------------------------------------------------------------------------------


def check_output(out: Path, force: bool, inputs: list[Path]) -> Path:
    """Refuse to write into a non-empty folder without --force, or over/around an input ever."""
    out = Path(out).resolve()
    for p in inputs:
        p = Path(p).resolve()
        if out == p or out in p.parents:
            raise UserError(f"--save {out} would overwrite the input {p}")
    if out == Path.home().resolve() or out == Path.cwd().resolve() or out.parent == out:
        raise UserError(f"--save {out}: refusing to replace this folder; pass a new folder")
    if out.exists() and not out.is_dir():
        raise UserError(f"--save {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"--save {out} is not empty: pass --force to replace it")
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"--save {out}: cannot create it under {parent} (not a writable folder)")
    return out


def check_free_space(out: Path, nbytes: int) -> None:
    """Fail before writing anything when the output's file system cannot hold it (~ nbytes + 5%)."""
    parent = out
    while not parent.exists():
        parent = parent.parent
    free = shutil.disk_usage(parent).free
    if free < nbytes * 1.05:
        raise UserError(f"--save {out}: needs about {human_bytes(nbytes)} but only {human_bytes(free)} "
                        f"is free on that file system")


def staging_dir(out: Path) -> Path:
    """Everything is written here first and renamed to `out` at the end: a failed run leaves no half output.

    (A sibling folder, so the rename stays on one file system; a leftover from a crash is removed.)
    """
    return out.with_name(out.name + ".partial")


def fresh_staging_dir(out: Path) -> Path:
    staging = staging_dir(out)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def publish(staging: Path, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
