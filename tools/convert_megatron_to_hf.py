"""Megatron distributed checkpoint -> Hugging Face folder (safetensors, config.json, tokenizer files).

    python tools/convert_megatron_to_hf.py --load ckpt/run/step_00000200 --save hf/run-step200 \\
        [--hf-dir Qwen2.5-32B] [--max-shard-size 5GB] [--dtype bfloat16] [--verify]

No --tp/--pp: a distributed checkpoint stores every tensor with its global shape, whatever TP/PP
saved it, so the tool reads it as one process without knowing the training layout (the flags are
accepted and ignored, with a note, because people pass them by habit).

--load takes a checkpoint folder (with its COMPLETE marker: a converted one, or a trainer's
step_<N>/, optimizer state is skipped) or a folder of step_<N>/ checkpoints (the latest complete one
is used). The architecture comes from config.json: the copy a converted checkpoint keeps in hf/, or
--hf-dir (both given: they must describe the same model). Tokenizer and generation-config files are
copied from --tokenizer-dir, else --hf-dir, else the checkpoint's hf/.

Streaming: tensors are read from the checkpoint one output file at a time (memory ~ one
--max-shard-size file plus one tensor); above that size the output is sharded like transformers
does (model-0000k-of-0000n.safetensors + model.safetensors.index.json).

Checks before writing: config supported and consistent with every stored tensor's shape and the
layer count, no stored model tensor left unexplained, output folder empty (or --force).
`--verify` builds an fp32 Megatron model from the checkpoint (TP=1, the whole model in memory) and
compares its logits on a fixed token batch with transformers loading the written folder.

Exit codes: 0 done (and verified), 1 verification failed, 2 invalid input or refused.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _convert_common as cc  # noqa: E402

PROG = "convert_megatron_to_hf"
DTYPES = ("auto", "float32", "bfloat16", "float16")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# Checkpoint keys of the local layer spec where Transformer Engine fuses the norm into the next linear.
_LOCAL_KEYS = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
               "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}
_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, type=Path,
                   help="checkpoint folder, or a folder of step_<N>/ checkpoints (the latest is used)")
    p.add_argument("--save", required=True, type=Path, help="output HF folder (must be empty or absent)")
    p.add_argument("--hf-dir", type=Path, help="HF folder with the model's config.json (and tokenizer files)")
    p.add_argument("--tokenizer-dir", type=Path, help="copy tokenizer files from here instead")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="output dtype; auto = the checkpoint's")
    p.add_argument("--max-shard-size", default="5GB",
                   help="split the safetensors output above this size (default 5GB)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --save folder")
    p.add_argument("--verify", action="store_true", help="compare logits of the output with the checkpoint's")
    p.add_argument("--tol", type=float, default=1e-4,
                   help="--verify: max allowed |logit diff| (fp32 compute)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    for flag in ("--tp", "--pp", "--tensor-parallel", "--pipeline-parallel", "--tensor-model-parallel-size",
                 "--pipeline-model-parallel-size"):
        p.add_argument(flag, dest="ignored_" + flag.strip("-").replace("-", "_"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    start = time.perf_counter()
    args = parse_args(argv)
    cc.quiet_megatron()
    max_shard = cc.parse_size(args.max_shard_size)
    ckpt = resolve_checkpoint(args.load)
    spec, raw_config, config_from = read_config(args, ckpt)
    inputs = [p for p in (args.load, args.hf_dir, args.tokenizer_dir) if p]
    out = cc.check_output(args.save, args.force, inputs)
    tok_dir = args.tokenizer_dir or args.hf_dir or (ckpt / cc.HF_SUBDIR)
    if not tok_dir.is_dir():
        raise cc.UserError(f"--tokenizer-dir {tok_dir}: no such folder")
    _note_ignored_layout(args, ckpt)

    import torch

    from megatron_dapo import parallel
    from megatron_dapo.config import ParallelConfig

    if parallel.launch_env().world_size != 1:
        raise cc.preflight_error(cc.UserError("runs as ONE process (it reads a checkpoint of any TP/PP): "
                                              "start it with python, not torchrun/srun"))
    parallel.initialize(ParallelConfig(), seed=0)
    reader = CheckpointReader(ckpt, spec)
    dtype = reader.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    cc.check_free_space(out, reader.numel() * torch.empty((), dtype=dtype).element_size())
    staging = cc.staging_dir(out)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    files, total = write_safetensors(reader, spec, dtype, staging, max_shard, show=not args.quiet)
    (staging / "config.json").write_bytes(config_with_dtype(raw_config, dtype))
    copied = cc.copy_aux_files(tok_dir, staging)
    cc.publish(staging, out)
    print(f"{PROG}: {len(reader.rules_hf_names())} tensors, {cc.human_bytes(total)} in {len(files)} "
          f"safetensors file(s), {str(dtype).removeprefix('torch.')}, config from {config_from}, "
          f"{len(copied)} tokenizer/aux file(s) from {tok_dir}, {time.perf_counter() - start:.1f} s -> {out}",
          flush=True)
    code = verify(args, spec, ckpt, out) if args.verify else cc.EXIT_OK
    parallel.destroy()
    return code


def resolve_checkpoint(load: Path) -> Path:
    from megatron_dapo.actor.checkpoint import latest_checkpoint

    if not load.is_dir():
        raise cc.UserError(f"--load {load}: no such folder")
    if (load / "COMPLETE").is_file():
        return load
    if (load / "metadata.json").is_file():
        raise cc.UserError(f"--load {load}: incomplete checkpoint (no COMPLETE marker): an interrupted save?")
    if (load / "config.json").is_file() and any(load.glob("*.safetensors*")):
        raise cc.UserError(f"--load {load} is a Hugging Face folder, not a Megatron checkpoint "
                           "(use convert_hf_to_megatron.py for that direction)")
    latest = latest_checkpoint(load)
    if latest is None:
        raise cc.UserError(f"--load {load}: neither a checkpoint (no COMPLETE marker) nor a folder of "
                           "complete step_<N>/ checkpoints")
    print(f"{PROG}: using the latest complete checkpoint {latest}", flush=True)
    return latest


def read_config(args: argparse.Namespace, ckpt: Path):
    """(spec, config.json bytes, where it came from); --hf-dir and the stored copy must agree."""
    from megatron_dapo.actor.model import spec_from_hf

    stored = ckpt / cc.HF_SUBDIR
    have_stored = (stored / "config.json").is_file()
    if args.hf_dir is None and not have_stored:
        raise cc.UserError(f"--load {ckpt} keeps no config.json (a training checkpoint?): pass --hf-dir "
                           "with the model's Hugging Face folder (config.json, tokenizer files)")
    source = args.hf_dir if args.hf_dir is not None else stored
    hf_config, raw = cc.read_hf_config(source)
    spec = spec_from_hf(hf_config)
    if args.hf_dir is not None and have_stored:
        diff = cc.spec_difference(spec_from_hf(cc.read_hf_config(stored)[0]), spec)
        if diff:
            raise cc.UserError(f"--hf-dir {args.hf_dir} describes a different model than the checkpoint's "
                               f"{stored / 'config.json'} ({'; '.join(diff)})")
    return spec, raw, source / "config.json"


def _note_ignored_layout(args: argparse.Namespace, ckpt: Path) -> None:
    given = {k.removeprefix("ignored_"): v for k, v in vars(args).items() if k.startswith("ignored_") and v}
    if not given:
        return
    saved = ""
    info = ckpt / cc.CONVERSION_FILE
    if info.is_file():
        w = json.loads(info.read_text()).get("written_with", {})
        saved = f" (this one was written with TP={w.get('tensor_parallel')} PP={w.get('pipeline_parallel')})"
    flags = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in given.items())
    print(f"{PROG}: note: ignoring {flags}: "
          f"the layout is read from the checkpoint, which loads at any TP/PP{saved}",
          file=sys.stderr, flush=True)


@dataclass
class _Entry:
    rule: object       # hf_mapping.TensorRule (TE naming, PP=1)
    key: str           # dist-checkpoint key
    layer: int | None  # index into the stacked layer axis, None if the key holds this tensor alone
    nbytes_out: int = 0


class CheckpointReader:
    """Reads full (unsharded) Megatron tensors from a dist checkpoint by rule, checked against the config."""

    def __init__(self, ckpt: Path, spec):
        from megatron.core import dist_checkpointing

        from megatron_dapo.actor.hf_mapping import stage_rules

        self.ckpt, self.spec = ckpt, spec
        try:
            self.meta = dist_checkpointing.load_tensors_metadata(str(ckpt))
        except Exception as e:  # a damaged .metadata / metadata.json
            raise cc.UserError(f"--load {ckpt}: cannot read the checkpoint metadata ({e})") from e
        self.entries = [self._locate(rule) for rule in stage_rules(spec, 0, 1, te=True)]
        used = {e.key for e in self.entries}
        extra = sorted(k for k in self.meta if k.startswith(_MODEL_PREFIXES) and k not in used
                       and not (k == "output_layer.weight" and spec.tied_embeddings))
        if extra:
            raise cc.UserError(f"{ckpt}: stores {len(extra)} model tensor(s) that config.json does not "
                               f"describe, e.g. {extra[0]} (was it written for a different model?)")
        emb = self.meta[self.entries[0].key]
        self.dtype = emb.dtype

    def _locate(self, rule) -> _Entry:
        key, layer = None, None
        m = _LAYER.match(rule.megatron_name)
        if m is None:
            key = rule.megatron_name if rule.megatron_name in self.meta else None
        else:
            i, rest = int(m.group(1)), m.group(2)
            for name in (rest, _LOCAL_KEYS.get(rest)):
                if name and f"decoder.layers.{i}.{name}" in self.meta:
                    key = f"decoder.layers.{i}.{name}"
                elif name and f"decoder.layers.{name}" in self.meta:
                    key, layer = f"decoder.layers.{name}", i
                if key:
                    break
        if key is None:
            raise cc.UserError(f"{self.ckpt}: no tensor for {rule.megatron_name} "
                               f"(HF {', '.join(rule.hf_names)}); config.json says "
                               f"num_hidden_layers={self.spec.num_layers}, "
                               f"tie_word_embeddings={self.spec.tied_embeddings}, "
                               f"qkv bias={self.spec.qkv_bias}")
        self._check_shape(rule, key, layer)
        return _Entry(rule, key, layer)

    def _check_shape(self, rule, key: str, layer: int | None) -> None:
        shape = tuple(self.meta[key].global_shape)
        if layer is not None:
            if shape[0] != self.spec.num_layers:
                raise cc.UserError(f"{self.ckpt}: the checkpoint has {shape[0]} layers, config.json says "
                                   f"num_hidden_layers={self.spec.num_layers}")
            shape = shape[1:]
        want = full_shape(rule, self.spec)
        if rule.kind == "vocab":
            ok = shape[1:] == want[1:] and shape[0] >= want[0]
        else:
            ok = shape == want
        if not ok:
            raise cc.UserError(f"{self.ckpt}: {key} has shape {list(shape)} but config.json implies "
                               f"{list(want)} "
                               f"({'rows >= vocab_size, ' if rule.kind == 'vocab' else ''}HF "
                               f"{', '.join(rule.hf_names)}; hidden_size={self.spec.hidden_size}, "
                               f"intermediate_size={self.spec.ffn_hidden_size}, heads={self.spec.num_heads}, "
                               f"kv_heads={self.spec.num_kv_heads}, vocab_size={self.spec.vocab_size})")

    def numel(self) -> int:
        """Elements of the HF tensors the checkpoint converts to."""
        import math

        from megatron_dapo.actor.hf_mapping import expected_hf_shape

        return sum(math.prod(expected_hf_shape(n, self.spec)) for n in self.rules_hf_names())

    def rules_hf_names(self) -> list[str]:
        return [n for e in self.entries for n in e.rule.hf_names]

    def load(self, entries: list[_Entry]) -> dict[str, object]:
        """megatron name -> full tensor (vocab padding removed), in one read of the checkpoint."""
        import torch
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing import ShardedTensor

        request = {}
        for e in entries:
            st = self.meta[e.key]
            if e.layer is None:
                buf = torch.empty(st.global_shape, dtype=st.dtype)
                request[e.rule.megatron_name] = ShardedTensor.from_rank_offsets(e.key, buf, replica_id=0)
            else:
                buf = torch.empty((1, *st.global_shape[1:]), dtype=st.dtype)
                request[e.rule.megatron_name] = ShardedTensor.from_rank_offsets(
                    e.key, buf, (0, e.layer, st.global_shape[0]), replica_id=0)
        loaded = dist_checkpointing.load(request, str(self.ckpt), validate_access_integrity=False)
        out = {}
        for e in entries:
            t = loaded[e.rule.megatron_name]
            t = t[0] if e.layer is not None else t
            out[e.rule.megatron_name] = t[: self.spec.vocab_size] if e.rule.kind == "vocab" else t
        return out


def full_shape(rule, spec) -> tuple[int, ...]:
    """The unpadded full Megatron shape of a rule, derived from the HF shapes through the one map."""
    import torch

    from megatron_dapo.actor.hf_mapping import expected_hf_shape, hf_to_megatron

    parts = [torch.empty(expected_hf_shape(n, spec), device="meta") for n in rule.hf_names]
    return tuple(hf_to_megatron(parts, rule, spec).shape)


def plan_shards(entries: list[_Entry], spec, itemsize: int, max_bytes: int) -> list[list[_Entry]]:
    """Greedy packing in model order; a rule's HF tensors (e.g. q, k, v) stay in one file."""
    import math

    from megatron_dapo.actor.hf_mapping import expected_hf_shape

    shards: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        e.nbytes_out = sum(math.prod(expected_hf_shape(n, spec)) for n in e.rule.hf_names) * itemsize
        if shards[-1] and size + e.nbytes_out > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes_out
    return shards


def write_safetensors(reader: CheckpointReader, spec, dtype, folder: Path, max_bytes: int, show: bool):
    """Write model.safetensors (or shards + index); returns (file names, tensor bytes)."""
    import torch
    from safetensors.torch import save_file

    from megatron_dapo.actor.hf_mapping import megatron_to_hf

    shards = plan_shards(reader.entries, spec, torch.empty((), dtype=dtype).element_size(), max_bytes)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else \
        [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map, total = {}, 0
    with cc.progress(len(reader.rules_hf_names()), "Megatron -> HF", show) as bar:
        for file, entries in zip(names, shards):
            full = reader.load(entries)
            tensors = {}
            for e in entries:
                parts = megatron_to_hf(full.pop(e.rule.megatron_name), e.rule, spec)
                for name, t in zip(e.rule.hf_names, parts):
                    tensors[name] = t.to(dtype=dtype, copy=True).contiguous()
                    weight_map[name] = file
                    total += tensors[name].numel() * tensors[name].element_size()
                    bar.update(1)
            save_file(tensors, str(folder / file), metadata={"format": "pt"})
            del tensors, full
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names, total


def config_with_dtype(raw: bytes, dtype) -> bytes:
    """config.json unchanged (byte for byte) unless its dtype field names a different dtype."""
    fields = json.loads(raw)
    name = str(dtype).removeprefix("torch.")
    key = "dtype" if "dtype" in fields or "torch_dtype" not in fields else "torch_dtype"
    if fields.get(key) == name:
        return raw
    fields[key] = name
    return (json.dumps(fields, indent=2, sort_keys=True) + "\n").encode()


def verify(args: argparse.Namespace, spec, ckpt: Path, out: Path) -> int:
    model = cc.build_stage(spec, "float32", 1, 1)
    cc.load_weights_only(model, ckpt)
    tokens = cc.verify_tokens(spec)
    logits = cc.megatron_logits(model, tokens, spec.vocab_size)
    del model
    diff, agree = cc.compare_logits(logits, cc.hf_logits(out, tokens))
    return cc.report_verify(PROG, diff, agree, tokens.numel(), args.tol,
                            f"(transformers on {out.name} vs the checkpoint in Megatron, TP=1)")


if __name__ == "__main__":
    sys.exit(cc.run_cli(PROG, main))
