"""Checkpoint conversion, both directions (the library behind tools/convert_*.py).

HF -> Megatron (`hf_to_megatron`, collective over TP x PP ranks): every rank checks the inputs, builds
its stage, reads only the HF tensors it holds a piece of (lazily, one at a time) and the ranks write
one weights-only dist checkpoint that loads at any TP/PP (layout in convert_checks.py).
Megatron -> HF (`megatron_to_hf`, one process): tensors are read from the dist checkpoint one output
file at a time and written as safetensors (sharded above `max_shard_size`, with an index).

Each direction first runs every check that needs no Megatron (`preflight_to_megatron`,
`prepare_to_hf`), writes into a staging folder that is renamed at the end, and with `verify` compares
logits with transformers (convert_verify.py). Messages start with the tool's name (`prog`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_dapo.actor import convert_checks as checks
from megatron_dapo.actor import convert_verify as cv
from megatron_dapo.actor.convert_reader import CheckpointReader, plan_shards
from megatron_dapo.actor.model import ModelSpec
from megatron_dapo.cli import UserError, preflight_error
from megatron_dapo.hf_files import copy_aux_files, hf_tensor_table


@dataclass(kw_only=True)
class ToMegatron:
    hf_dir: Path
    save: Path
    tp: int = 1
    pp: int = 1
    dtype: str = "auto"  # auto | float32 | bfloat16
    force: bool = False
    verify: bool = False
    tol: float = 1e-4
    quiet: bool = False


@dataclass(kw_only=True)
class ToMegatronPlan:
    spec: ModelSpec
    raw_config: bytes
    source_dtype: str
    dtype: str
    out: Path


def preflight_to_megatron(cfg: ToMegatron) -> ToMegatronPlan:
    """Everything that can be checked without Megatron; identical on every rank."""
    from megatron_dapo.actor.model import spec_from_hf, validate_layout

    try:
        hf_config, raw_config = checks.read_hf_config(cfg.hf_dir)
        spec = spec_from_hf(hf_config)
        validate_layout(spec, cfg.tp, cfg.pp)
        table = hf_tensor_table(cfg.hf_dir)
        source_dtype = checks.check_hf_tensors(table, spec, cfg.hf_dir)
        out = checks.check_output(cfg.save, cfg.force, [cfg.hf_dir])
        if cfg.dtype != "auto":
            dtype = cfg.dtype
        else:
            dtype = source_dtype if source_dtype in ("float32", "bfloat16") else "float32"
        checks.check_free_space(out, checks.hf_numel(table, spec) * (4 if dtype == "float32" else 2))
    except checks.USER_ERRORS as e:
        raise preflight_error(e) from e
    return ToMegatronPlan(spec=spec, raw_config=raw_config, source_dtype=source_dtype, dtype=dtype, out=out)


def hf_to_megatron(cfg: ToMegatron, prog: str) -> int:
    """Collective over tp x pp ranks: convert, publish, optionally verify; returns the exit code."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_dapo import parallel
    from megatron_dapo.config import ParallelConfig

    start = time.perf_counter()
    plan = preflight_to_megatron(cfg)
    parallel.initialize(ParallelConfig(tensor_parallel=cfg.tp, pipeline_parallel=cfg.pp), seed=0)
    main_rank = parallel.is_main()
    staging = checks.staging_dir(plan.out)
    if main_rank:
        checks.fresh_staging_dir(plan.out)
        if plan.source_dtype != plan.dtype:
            print(f"{prog}: HF tensors are {plan.source_dtype}, stored as {plan.dtype}", flush=True)

    model = cv.build_stage(plan.spec, plan.dtype, cfg.tp, cfg.pp)
    counts = torch.tensor(_load_stage(model, plan.spec, cfg.hf_dir, show=main_rank and not cfg.quiet),
                          dtype=torch.float64)
    if parallel.tp_rank() != 0:  # every TP rank reads the same HF tensors: count them once per stage
        counts.zero_()
    dist.all_reduce(counts)
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict()}, str(staging))
    dist.barrier()
    del model
    if main_rank:
        _finish_megatron_folder(cfg, plan, staging, int(counts[0]), int(counts[1]))
        checks.publish(staging, plan.out)
        print(f"{prog}: {int(counts[0])} tensors, {checks.human_bytes(int(counts[1]))} read, "
              f"{checks.human_bytes(checks.dir_bytes(plan.out))} written, TP={cfg.tp} PP={cfg.pp} "
              f"{plan.dtype}, {time.perf_counter() - start:.1f} s -> {plan.out} (loads at any TP/PP)",
              flush=True)
    dist.barrier()
    code = _verify_megatron(cfg, plan.spec, plan.out, prog) if cfg.verify else checks.EXIT_OK
    parallel.destroy()
    return code


def _finish_megatron_folder(cfg: ToMegatron, plan: ToMegatronPlan, staging: Path, tensors: int,
                            nbytes: int) -> None:
    hf_files = copy_aux_files(cfg.hf_dir, staging / checks.HF_SUBDIR)
    (staging / checks.HF_SUBDIR / "config.json").write_bytes(plan.raw_config)
    info = {"format": "megatron_dapo weights-only checkpoint", "source": str(Path(cfg.hf_dir).resolve()),
            "written_with": {"tensor_parallel": cfg.tp, "pipeline_parallel": cfg.pp},
            "dtype": plan.dtype, "source_dtype": plan.source_dtype, "hf_tensors": tensors, "hf_bytes": nbytes,
            "hf_files": ["config.json", *hf_files]}
    (staging / checks.CONVERSION_FILE).write_text(json.dumps(info, indent=2) + "\n")
    from megatron_dapo.actor.checkpoint_files import write_manifest

    write_manifest(staging, collective=False)  # load_checkpoint verifies it
    (staging / "COMPLETE").write_text("0")


def _load_stage(model, spec: ModelSpec, hf_dir: Path, show: bool) -> tuple[int, int]:
    """Copy this rank's shard of every HF tensor into `model`; returns (HF tensors read, bytes read)."""
    from megatron_dapo import parallel
    from megatron_dapo.actor.hf_io import SafetensorsReader, load_hf_weights
    from megatron_dapo.actor.hf_mapping import stage_rules

    rules = stage_rules(spec, parallel.pp_rank(), parallel.pp_size())
    rules_total = sum(len(r.hf_names) for r in rules)
    stage = f"stage {parallel.pp_rank() + 1}/{parallel.pp_size()} " if parallel.pp_size() > 1 else ""
    with checks.progress(rules_total, f"{stage}HF -> Megatron", show) as bar:
        counting = _CountingReader(SafetensorsReader(hf_dir), bar)
        nbytes = load_hf_weights(model, counting, spec)
    own = {n for r in rules if r.exported for n in r.hf_names}  # the tied lm_head copy is not an HF tensor
    return len(counting.names & own), nbytes


class _CountingReader:
    """A SafetensorsReader that advances the progress bar and remembers which tensors were read."""

    def __init__(self, reader, bar):
        self.reader, self.bar, self.names = reader, bar, set()

    def __contains__(self, name: str) -> bool:
        return name in self.reader

    def get(self, name: str):
        t = self.reader.get(name)
        self.names.add(name)
        self.bar.update(1)
        return t


def _verify_megatron(cfg: ToMegatron, spec: ModelSpec, out: Path, prog: str) -> int:
    """Reload OUT into a fresh fp32 model at this layout; compare logits with transformers on one rank."""
    import torch
    import torch.distributed as dist

    from megatron_dapo import parallel

    model = cv.build_stage(spec, "float32", cfg.tp, cfg.pp)
    cv.load_weights_only(model, out)
    tokens = cv.verify_tokens(spec)
    logits = cv.megatron_logits(model, tokens, spec.vocab_size)
    del model
    result = torch.zeros(2, dtype=torch.float64)
    if logits is not None and parallel.tp_rank() == 0:
        result[:] = torch.tensor(cv.compare_logits(logits, cv.hf_logits(cfg.hf_dir, tokens)))
    dist.all_reduce(result)  # exactly one rank (last stage, TP rank 0) contributes
    diff, agree = result.tolist()
    if parallel.is_main():
        return cv.report_verify(prog, diff, agree, tokens.numel(), cfg.tol,
                                f"(checkpoint reloaded at TP={cfg.tp} PP={cfg.pp} vs transformers)")
    return checks.EXIT_OK if diff <= cfg.tol else checks.EXIT_VERIFY_FAILED


# --- Megatron -> HF -------------------------------------------------------------------------------


@dataclass(kw_only=True)
class ToHF:
    load: Path
    save: Path
    hf_dir: Path | None = None
    tokenizer_dir: Path | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_shard_size: str = "5GB"
    force: bool = False
    verify: bool = False
    tol: float = 1e-4
    quiet: bool = False


@dataclass(kw_only=True)
class ToHFPlan:
    ckpt: Path
    spec: ModelSpec
    raw_config: bytes
    config_from: Path
    out: Path
    tok_dir: Path
    max_shard: int
    start: float  # time.perf_counter() when the checks began


def prepare_to_hf(cfg: ToHF, prog: str) -> ToHFPlan:
    """The checks before Megatron starts: checkpoint, config, output folder, tokenizer folder."""
    start = time.perf_counter()
    max_shard = checks.parse_size(cfg.max_shard_size)
    ckpt = checks.resolve_checkpoint(cfg.load)
    if ckpt != cfg.load:
        print(f"{prog}: using the latest complete checkpoint {ckpt}", flush=True)
    spec, raw_config, config_from = checks.checkpoint_config(ckpt, cfg.hf_dir)
    inputs = [p for p in (cfg.load, cfg.hf_dir, cfg.tokenizer_dir) if p]
    out = checks.check_output(cfg.save, cfg.force, inputs)
    tok_dir = cfg.tokenizer_dir or cfg.hf_dir or (ckpt / checks.HF_SUBDIR)
    if not tok_dir.is_dir():
        raise UserError(f"--tokenizer-dir {tok_dir}: no such folder")
    return ToHFPlan(ckpt=ckpt, spec=spec, raw_config=raw_config, config_from=config_from, out=out,
                    tok_dir=tok_dir, max_shard=max_shard, start=start)


def megatron_to_hf(cfg: ToHF, plan: ToHFPlan, prog: str) -> int:
    """One process: write the HF folder, publish it, optionally verify; returns the exit code."""
    import torch

    from megatron_dapo import parallel
    from megatron_dapo.config import ParallelConfig

    if parallel.launch_env().world_size != 1:
        raise preflight_error(UserError("runs as ONE process (it reads a checkpoint of any TP/PP): "
                                        "start it with python, not torchrun/srun"))
    parallel.initialize(ParallelConfig(), seed=0)
    reader = CheckpointReader(plan.ckpt, plan.spec)
    dtype = reader.dtype if cfg.dtype == "auto" else getattr(torch, cfg.dtype)
    checks.check_free_space(plan.out, reader.numel() * torch.empty((), dtype=dtype).element_size())
    staging = checks.fresh_staging_dir(plan.out)
    files, total = write_safetensors(reader, plan.spec, dtype, staging, plan.max_shard, show=not cfg.quiet)
    (staging / "config.json").write_bytes(config_with_dtype(plan.raw_config, dtype))
    copied = copy_aux_files(plan.tok_dir, staging)
    checks.publish(staging, plan.out)
    print(f"{prog}: {len(reader.rules_hf_names())} tensors, {checks.human_bytes(total)} in {len(files)} "
          f"safetensors file(s), {str(dtype).removeprefix('torch.')}, config from {plan.config_from}, "
          f"{len(copied)} tokenizer/aux file(s) from {plan.tok_dir}, "
          f"{time.perf_counter() - plan.start:.1f} s -> {plan.out}", flush=True)
    code = _verify_hf(cfg, plan, prog) if cfg.verify else checks.EXIT_OK
    parallel.destroy()
    return code


def write_safetensors(reader: CheckpointReader, spec: ModelSpec, dtype, folder: Path, max_bytes: int,
                      show: bool) -> tuple[list[str], int]:
    """Write model.safetensors (or shards + index); returns (file names, tensor bytes)."""
    import torch
    from safetensors.torch import save_file

    from megatron_dapo.actor.hf_mapping import megatron_to_hf as to_hf_layout

    shards = plan_shards(reader.entries, spec, torch.empty((), dtype=dtype).element_size(), max_bytes)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else \
        [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map, total = {}, 0
    with checks.progress(len(reader.rules_hf_names()), "Megatron -> HF", show) as bar:
        for file, entries in zip(names, shards):
            full = reader.load(entries)
            tensors = {}
            for e in entries:
                parts = to_hf_layout(full.pop(e.rule.megatron_name), e.rule, spec)
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


def _verify_hf(cfg: ToHF, plan: ToHFPlan, prog: str) -> int:
    model = cv.build_stage(plan.spec, "float32", 1, 1)
    cv.load_weights_only(model, plan.ckpt)
    tokens = cv.verify_tokens(plan.spec)
    logits = cv.megatron_logits(model, tokens, plan.spec.vocab_size)
    del model
    diff, agree = cv.compare_logits(logits, cv.hf_logits(plan.out, tokens))
    return cv.report_verify(prog, diff, agree, tokens.numel(), cfg.tol,
                            f"(transformers on {plan.out.name} vs the checkpoint in Megatron, TP=1)")
