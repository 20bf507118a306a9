"""A Hugging Face model folder on disk: safetensors headers, lazy tensor reads, auxiliary files.

The one reader of HF folders for the whole package (the actor, the conversion tools and the rollout
engines use it), so it imports nothing of actor/ or rollout/. Headers are read and checked without
loading a tensor: a truncated or corrupt file fails with the file's name, not deep inside a load.

    table = hf_tensor_table(folder)            # name -> TensorInfo(file, dtype, shape), headers only
    reader = SafetensorsReader(folder)         # reader.get(name) -> torch.Tensor, memory-mapped
    shapes = checkpoint_shapes(folder)         # name -> shape (tied lm_head included), None if no weights
    copy_aux_files(folder, out)                # tokenizer, chat template, generation config, ...
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any, NamedTuple

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Files of an HF folder that are weights (never auxiliary files) or written by whoever writes weights.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
_WEIGHT_INDEXES = {SAFETENSORS_INDEX, "pytorch_model.bin.index.json"}
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
             "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class HFCheckpointError(ValueError):
    """An HF checkpoint that is unreadable or does not match its config; the message names the file."""


class TensorInfo(NamedTuple):
    file: str                # file name inside the folder
    dtype: str               # safetensors dtype name: F32, BF16, ...
    shape: tuple[int, ...]


def read_safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) from the header; truncated or corrupt files fail clearly."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise HFCheckpointError(f"{path}: truncated ({size} bytes): not a safetensors file")
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            raise HFCheckpointError(f"{path}: truncated inside its header (the header is {n} bytes, the file "
                                    f"{size}): an interrupted download or copy?")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HFCheckpointError(f"{path}: corrupt safetensors header ({e})") from e
    try:
        header.pop("__metadata__", None)
        entries = {name: (info["dtype"], tuple(info["shape"]), tuple(info["data_offsets"]))
                   for name, info in header.items()}
    except (AttributeError, KeyError, TypeError) as e:
        raise HFCheckpointError(f"{path}: corrupt safetensors header (an entry without dtype, shape or "
                                f"data_offsets: {e!r})") from e
    data_bytes = size - 8 - n
    out = {}
    for name, (dtype, shape, (begin, end)) in entries.items():
        if dtype in _ITEMSIZE and end - begin != math.prod(shape) * _ITEMSIZE[dtype]:
            raise HFCheckpointError(f"{path}: corrupt header: {name} {dtype}{list(shape)} spans "
                                    f"{end - begin} bytes")
        if end > data_bytes:
            raise HFCheckpointError(f"{path}: truncated: {name} ends at byte {end} of the data but the "
                                    f"file holds only {data_bytes} bytes of data (an interrupted download "
                                    "or copy?)")
        out[name] = (dtype, shape)
    return out


def hf_tensor_table(hf_dir: str | Path) -> dict[str, TensorInfo]:
    """name -> TensorInfo over model.safetensors or a sharded index (every listed file's header checked)."""
    hf_dir = Path(hf_dir)
    index = hf_dir / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise HFCheckpointError(f"{index}: not a safetensors index ({e})") from e
        files = sorted(set(weight_map.values()))
    elif (hf_dir / SAFETENSORS).is_file():
        weight_map, files = None, [SAFETENSORS]
    elif any(hf_dir.glob("*.bin")):
        raise HFCheckpointError(f"{hf_dir}: only PyTorch .bin weights; save the model with safetensors first "
                                "(model.save_pretrained(dir, safe_serialization=True))")
    else:
        raise HFCheckpointError(f"{hf_dir}: no {SAFETENSORS} or {SAFETENSORS_INDEX}")
    table = {}
    for file in files:
        path = hf_dir / file
        if not path.is_file():
            raise HFCheckpointError(f"{index}: lists {file}, which is missing")
        for name, (dtype, shape) in read_safetensors_header(path).items():
            if weight_map is None or weight_map.get(name) == file:
                table[name] = TensorInfo(file, dtype, shape)
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(table))
        if missing:
            raise HFCheckpointError(f"{index}: {missing[0]} is listed in {weight_map[missing[0]]} but not "
                                    "stored there"
                                    + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return table


class SafetensorsReader:
    """Lazy name -> tensor access over a (possibly sharded) safetensors checkpoint; headers checked first."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        self.table = hf_tensor_table(self.dir)
        self._open: dict[str, Any] = {}

    @property
    def weight_map(self) -> dict[str, str]:
        """name -> file, as in a safetensors index."""
        return {name: info.file for name, info in self.table.items()}

    def __contains__(self, name: str) -> bool:
        return name in self.table

    def get(self, name: str) -> Any:
        """The tensor `name` (a torch.Tensor), read from its file (memory-mapped)."""
        from safetensors import safe_open

        if name not in self.table:
            raise HFCheckpointError(f"{self.dir}: tensor {name!r} is missing")
        file = self.table[name].file
        try:
            if file not in self._open:
                self._open[file] = safe_open(str(self.dir / file), "pt")
            return self._open[file].get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for unreadable data
            raise HFCheckpointError(f"{self.dir / file}: cannot read {name!r} ({e})") from e


def checkpoint_shapes(hf_dir: str | Path) -> dict[str, tuple[int, ...]] | None:
    """name -> shape of every weight (headers only); a tied lm_head is filled in from config.json.

    None when the folder holds no safetensors file (e.g. a hub name instead of a folder).
    """
    hf_dir = Path(hf_dir)
    if not any(hf_dir.glob("*.safetensors")):
        return None
    shapes = {name: info.shape for name, info in hf_tensor_table(hf_dir).items()}
    cfg_file = hf_dir / "config.json"
    tied = cfg_file.is_file() and json.loads(cfg_file.read_text()).get("tie_word_embeddings", False)
    if tied and "lm_head.weight" not in shapes and "model.embed_tokens.weight" in shapes:
        shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    return shapes


def aux_files(hf_dir: str | Path, *, with_config: bool = False) -> list[Path]:
    """Every top-level file that is not weights or a weight index (tokenizer, chat template, generation
    config, README, ...); config.json only `with_config` (a converter rewrites it)."""
    skip = _WEIGHT_INDEXES if with_config else _WEIGHT_INDEXES | {"config.json"}
    return [p for p in sorted(Path(hf_dir).iterdir())
            if p.is_file() and p.name not in skip and not p.name.endswith(_WEIGHT_SUFFIXES)]


def copy_aux_files(src: str | Path, dst: str | Path, *, with_config: bool = False) -> list[str]:
    """Copy `aux_files(src)` into dst (created); returns the names copied."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    files = aux_files(src, with_config=with_config)
    for p in files:
        shutil.copy2(p, dst / p.name)
    return [p.name for p in files]
