"""Shared by tools/convert_hf_to_megatron.py and tools/convert_megatron_to_hf.py.

Names and shapes come from `megatron_dapo.actor.hf_mapping` (the one map); this module only adds
what the command-line tools need around it: checks that run before anything heavy is imported
(config, safetensors headers, output folder), the folder layout of a converted checkpoint, and the
logit comparison against transformers behind `--verify`.

A converted checkpoint is a weights-only actor checkpoint (see megatron_dapo/actor/checkpoint.py):

    OUT/                 dist_checkpointing files of {"model": GPTModel.sharded_state_dict()}
    OUT/COMPLETE         written last; `load_checkpoint(actor, OUT, load_optimizer=False)` needs it
    OUT/hf/              the source's config.json, generation_config.json and tokenizer files
    OUT/conversion.json  source path, TP/PP/dtype it was written with, tensor count, bytes
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import sys
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python tools/x.py` from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))

EXIT_OK, EXIT_VERIFY_FAILED, EXIT_USER_ERROR = 0, 1, 2
HF_SUBDIR = "hf"
CONVERSION_FILE = "conversion.json"
# Files of an HF model folder that are weights (never copied as "tokenizer files") or rewritten by us.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
_NOT_COPIED = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"}
# HF tensors that hold no weights of ours and may be dropped silently.
_IGNORABLE = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_ST_TO_DTYPE = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
VERIFY_SHAPE = (2, 32)  # batch x tokens of the fixed verification batch


class UserError(Exception):
    """Bad input or a refused action: printed as one line, exit code 2, no traceback."""


# --- command-line plumbing ----------------------------------------------------------------------


def run_cli(prog: str, main, argv: list[str] | None = None) -> int:
    """Run `main(argv)`; user errors become `prog: error: ...` on stderr and exit code 2."""
    from megatron_dapo.actor.hf_io import HFCheckpointError
    from megatron_dapo.actor.model import UnsupportedModelError

    try:
        return main(argv)
    except (UserError, HFCheckpointError, UnsupportedModelError) as e:
        same = getattr(e, "same_on_all_ranks", False)
        if _rank() == 0 or not same:
            prefix = f"[rank {_rank()}] " if _world() > 1 and not same else ""
            print(f"{prog}: error: {prefix}{e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def preflight_error(e: Exception) -> Exception:
    """Mark an error every rank hits identically (checks of the inputs): only rank 0 prints it."""
    e.same_on_all_ranks = True
    return e


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1)))


def quiet_megatron() -> None:
    """megatron-core warns that TE/apex are missing and about deprecations; transformers draws bars."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    for name in ("megatron", "megatron.core"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


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
    from megatron_dapo.actor.model import SUPPORTED_ARCHITECTURES, UnsupportedModelError

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


def read_safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) from the header; truncated or corrupt files fail clearly."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise UserError(f"{path}: truncated ({size} bytes): not a safetensors file")
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            raise UserError(f"{path}: truncated inside its header (the header is {n} bytes, the file "
                            f"{size}): an interrupted download or copy?")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{path}: corrupt safetensors header ({e})") from e
    header.pop("__metadata__", None)
    data_bytes = size - 8 - n
    out = {}
    for name, info in header.items():
        dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        if dtype in _ST_ITEMSIZE and end - begin != math.prod(shape) * _ST_ITEMSIZE[dtype]:
            raise UserError(f"{path}: corrupt header: {name} {dtype}{list(shape)} spans {end - begin} bytes")
        if end > data_bytes:
            raise UserError(f"{path}: truncated: {name} ends at byte {end} of the data but the file holds "
                            f"only {data_bytes} bytes of data (an interrupted download or copy?)")
        out[name] = (dtype, shape)
    return out


def hf_tensor_table(hf_dir: Path) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """name -> (file, dtype, shape) over model.safetensors or a sharded index."""
    hf_dir = Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise UserError(f"{index}: not a safetensors index ({e})") from e
        files = sorted(set(weight_map.values()))
    elif (hf_dir / "model.safetensors").is_file():
        weight_map, files = None, ["model.safetensors"]
    elif any(hf_dir.glob("*.bin")):
        raise UserError(f"{hf_dir}: only PyTorch .bin weights; save the model with safetensors first "
                        "(model.save_pretrained(dir, safe_serialization=True))")
    else:
        raise UserError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")
    table = {}
    for file in files:
        path = hf_dir / file
        if not path.is_file():
            raise UserError(f"{index}: lists {file}, which is missing")
        for name, (dtype, shape) in read_safetensors_header(path).items():
            if weight_map is None or weight_map.get(name) == file:
                table[name] = (file, dtype, shape)
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(table))
        if missing:
            raise UserError(f"{index}: {missing[0]} is listed in {weight_map[missing[0]]} but not stored "
                            "there"
                            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return table


def check_hf_tensors(table: dict, spec, hf_dir: Path) -> str:
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
    dtypes = {_ST_TO_DTYPE[table[n][1]] for n in needed}
    return dtypes.pop() if len(dtypes) == 1 else "mixed"


def hf_numel(table: dict, spec) -> int:
    """Elements of every tensor the model uses (for the size of what a conversion writes)."""
    from megatron_dapo.actor.hf_mapping import hf_names

    return sum(math.prod(table[n][2]) for n in hf_names(spec))


def copy_aux_files(src: Path, dst: Path) -> list[str]:
    """Copy tokenizer / generation-config files (every top-level file that is not weights or config.json)."""
    copied = []
    dst.mkdir(parents=True, exist_ok=True)
    for p in sorted(Path(src).iterdir()):
        if p.is_file() and p.name not in _NOT_COPIED and not p.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(p, dst / p.name)
            copied.append(p.name)
    return copied


def spec_difference(a, b) -> list[str]:
    da, db = asdict(a), asdict(b)
    return [f"{k}: {da[k]} vs {db[k]}" for k in da if da[k] != db[k]]


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


def publish(staging: Path, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)


# --- verification: Megatron vs transformers logits on a fixed batch --------------------------------


def verify_tokens(spec):
    import torch

    batch, seq = VERIFY_SHAPE
    g = torch.Generator().manual_seed(20260)
    return torch.randint(0, spec.vocab_size, (batch, min(seq, spec.max_position_embeddings)), generator=g)


def hf_logits(hf_dir: Path, tokens):
    """fp32 logits [b, s, vocab] of the transformers model in `hf_dir` (the independent reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                 attn_implementation="eager")
    with torch.no_grad():
        out = model.eval()(tokens).logits.float()
    del model
    return out


def megatron_logits(model, tokens, vocab_size: int):
    """Full fp32 logits [b, s, vocab] on the last pipeline stage (every TP rank), None on other stages."""
    import torch
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_dapo import megatron_cpu, parallel

    megatron_cpu.enter_thread()
    dev = parallel.device()
    result = {}

    def forward_step(data_iterator, m):
        ids = next(data_iterator).to(dev)
        pos = torch.arange(ids.shape[1], device=dev).expand_as(ids).contiguous()

        def keep(output):
            result["logits"] = output.detach().float()
            return output.new_zeros(()), torch.tensor(1, dtype=torch.int), {}

        return m(ids, pos, None), keep

    model.eval()
    with torch.no_grad():
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([tokens]),
                                    model=[model], num_microbatches=1, seq_length=tokens.shape[1],
                                    micro_batch_size=tokens.shape[0], forward_only=True)
    if "logits" not in result:
        return None
    local = result["logits"]
    if dist.is_initialized() and parallel.tp_size() > 1:
        parts = [torch.empty_like(local) for _ in range(parallel.tp_size())]
        dist.all_gather(parts, local.contiguous(), group=parallel.tp_group())
        local = torch.cat(parts, dim=-1)
    return local[..., :vocab_size].cpu()


def compare_logits(got, ref) -> tuple[float, float]:
    """(max |got - ref|, fraction of positions whose argmax agrees)."""
    diff = (got.double() - ref.double()).abs().max().item()
    agree = (got.argmax(-1) == ref.argmax(-1)).double().mean().item()
    return diff, agree


def report_verify(prog: str, diff: float, agree: float, n: int, tol: float, what: str) -> int:
    ok = diff <= tol and math.isfinite(diff)
    print(f"{prog}: verify {what}: max |logit diff| = {diff:.3e} (tolerance {tol:.0e}), "
          f"argmax agreement = {agree:.4f} over {n} tokens: {'OK' if ok else 'FAILED'}", flush=True)
    return EXIT_OK if ok else EXIT_VERIFY_FAILED


def build_stage(spec, dtype: str, tp: int, pp: int):
    """This rank's GPTModel stage (local layer spec: same checkpoint keys as Transformer Engine)."""
    from megatron_dapo.actor.model import build_model
    from megatron_dapo.config import ModelConfig, ParallelConfig

    return build_model(spec, ModelConfig(dtype=dtype, transformer_impl="local"),
                       ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp), init_weights=False)


def load_weights_only(model, ckpt: Path) -> None:
    """Collective: read the model part of a dist checkpoint at this TP/PP (as load_checkpoint does)."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(ckpt))
    model.load_state_dict(state["model"])
