"""Hugging Face (Qwen2 / Qwen2.5 / Llama safetensors) -> Megatron distributed checkpoint.

    python tools/convert_hf_to_megatron.py --hf-dir Qwen2.5-32B --save ckpt/qwen32b-init \
        [--tp 8 --pp 2] [--dtype bfloat16] [--verify]

The result is a weights-only actor checkpoint (COMPLETE marker, the HF config and tokenizer files in
OUT/hf/) that the actor loads at ANY TP/PP: megatron's dist_checkpointing reshards on load
(`model.load=OUT`, or `load_checkpoint(actor, OUT, load_optimizer=False)`). `--tp/--pp` only choose
the layout this tool runs with, i.e. how many processes share the memory; HF tensors are read lazily,
one at a time, and only by the ranks that hold a piece of them.

Processes: with --tp x --pp > 1, started as ONE process, the tool checks everything and then starts
T x P local ranks itself (torchrun's environment variables, gloo on CPU) and waits for them; if one
fails the others are stopped. Started by torchrun/srun with WORLD_SIZE = T x P (e.g. across nodes),
it runs as those ranks directly. Where CUDA is visible the ranks use nccl and one GPU each (so T x P
GPUs); `CUDA_VISIBLE_DEVICES= python tools/convert_hf_to_megatron.py ...` converts on CPU instead.
Memory per rank: its shard of the model plus about two of the largest HF tensors (the safetensors
files are memory-mapped; their pages count as reclaimable page cache).

Checks before anything is written: architecture supported, every tensor present with the shape
config.json implies and nothing unknown left over, safetensors files complete, TP divides the
heads / KV heads / FFN size, PP divides the layers, the output folder empty (or --force).
`--verify` reloads the written checkpoint into a fresh fp32 model at this layout and compares its
logits on a fixed token batch with transformers' (max |diff| <= --tol, default 1e-4).

Exit codes: 0 done (and verified), 1 verification failed, 2 invalid input or refused.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _convert_common as cc  # noqa: E402

PROG = "convert_hf_to_megatron"
_PARENT_ENV = "MEGATRON_DAPO_CONVERT_PARENT_PID"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True, type=Path,
                   help="Hugging Face model folder (config.json + safetensors)")
    p.add_argument("--save", required=True, type=Path,
                   help="output checkpoint folder (must be empty or absent)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size this tool runs with (any TP loads the result)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline-parallel size this tool runs with (any PP loads the result)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="stored parameter dtype; auto = the HF tensors' dtype (float16 is widened)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --save folder")
    p.add_argument("--verify", action="store_true",
                   help="compare logits of the written checkpoint with transformers")
    p.add_argument("--tol", type=float, default=1e-4,
                   help="--verify: max allowed |logit diff| (fp32 compute)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.tp < 1 or args.pp < 1:
        p.error("--tp and --pp must be >= 1")
    return args


def preflight(args: argparse.Namespace):
    """Everything that can be checked without Megatron; identical on every rank."""
    from megatron_dapo.actor.model import UnsupportedModelError, spec_from_hf, validate_layout

    try:
        hf_config, raw_config = cc.read_hf_config(args.hf_dir)
        spec = spec_from_hf(hf_config)
        validate_layout(spec, args.tp, args.pp)
        table = cc.hf_tensor_table(args.hf_dir)
        source_dtype = cc.check_hf_tensors(table, spec, args.hf_dir)
        out = cc.check_output(args.save, args.force, [args.hf_dir])
        if args.dtype != "auto":
            dtype = args.dtype
        else:
            dtype = source_dtype if source_dtype in ("float32", "bfloat16") else "float32"
        cc.check_free_space(out, cc.hf_numel(table, spec) * (4 if dtype == "float32" else 2))
    except (cc.UserError, UnsupportedModelError) as e:
        raise cc.preflight_error(e) from e
    return spec, raw_config, source_dtype, dtype, out


def main(argv: list[str] | None = None) -> int:
    _die_with_parent()
    args = parse_args(argv)
    cc.quiet_megatron()
    from megatron_dapo.parallel import launch_env

    world, wanted = launch_env().world_size, args.tp * args.pp
    if world == 1 and wanted > 1:
        preflight(args)  # fail fast, in this process, before starting ranks
        return spawn_ranks(wanted, sys.argv[1:] if argv is None else argv)
    if world != wanted:
        raise cc.preflight_error(cc.UserError(
            f"started as {world} ranks but --tp {args.tp} x --pp {args.pp} = {wanted}: start exactly "
            f"{wanted} ranks, or start the tool as one process and it starts them"))
    return convert(args)


def spawn_ranks(n: int, argv: list[str]) -> int:
    """Start n local ranks of this script (torchrun's environment) and wait; a failed rank stops the rest."""
    from megatron_dapo.parallel import free_port

    port = free_port()
    procs = []
    for rank in range(n):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
        env[_PARENT_ENV] = str(os.getpid())
        procs.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *argv], env=env))
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed or all(c == 0 for c in codes):
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        failed = [130]
    if failed:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        return failed[0]
    return cc.EXIT_OK


def _die_with_parent() -> None:
    """In a rank we spawned (Linux): SIGTERM when the launching process dies, so no rank is orphaned."""
    parent = os.environ.pop(_PARENT_ENV, None)
    if parent is None:
        return
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # it died before prctl took effect
        sys.exit(1)


def convert(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    spec, raw_config, source_dtype, dtype, out = preflight(args)
    import torch
    import torch.distributed as dist

    from megatron_dapo import parallel
    from megatron_dapo.config import ParallelConfig

    parallel.initialize(ParallelConfig(tensor_parallel=args.tp, pipeline_parallel=args.pp), seed=0)
    main_rank = parallel.is_main()
    staging = cc.staging_dir(out)
    if main_rank:
        if staging.exists():
            import shutil

            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        if source_dtype != dtype:
            print(f"{PROG}: HF tensors are {source_dtype}, stored as {dtype}", flush=True)

    model = cc.build_stage(spec, dtype, args.tp, args.pp)
    counts = torch.tensor(load_stage(model, spec, args.hf_dir, show=main_rank and not args.quiet),
                          dtype=torch.float64)
    if parallel.tp_rank() != 0:  # every TP rank reads the same HF tensors: count them once per stage
        counts.zero_()
    dist.all_reduce(counts)
    dist.barrier()

    from megatron.core import dist_checkpointing

    dist_checkpointing.save({"model": model.sharded_state_dict()}, str(staging))
    dist.barrier()
    del model
    tensors, nbytes = int(counts[0]), int(counts[1])
    if main_rank:
        hf_files = cc.copy_aux_files(args.hf_dir, staging / cc.HF_SUBDIR)
        (staging / cc.HF_SUBDIR / "config.json").write_bytes(raw_config)
        info = {"format": "megatron_dapo weights-only checkpoint", "source": str(Path(args.hf_dir).resolve()),
                "written_with": {"tensor_parallel": args.tp, "pipeline_parallel": args.pp},
                "dtype": dtype, "source_dtype": source_dtype, "hf_tensors": tensors, "hf_bytes": nbytes,
                "hf_files": ["config.json", *hf_files]}
        (staging / cc.CONVERSION_FILE).write_text(json.dumps(info, indent=2) + "\n")
        (staging / "COMPLETE").write_text("0")
        cc.publish(staging, out)
        print(f"{PROG}: {tensors} tensors, {cc.human_bytes(nbytes)} read, "
              f"{cc.human_bytes(cc.dir_bytes(out))} written, TP={args.tp} PP={args.pp} {dtype}, "
              f"{time.perf_counter() - start:.1f} s -> {out} (loads at any TP/PP)", flush=True)
    dist.barrier()
    code = verify(args, spec, out) if args.verify else cc.EXIT_OK
    parallel.destroy()
    return code


def load_stage(model, spec, hf_dir: Path, show: bool) -> tuple[int, int]:
    """Copy this rank's shard of every HF tensor into `model`; returns (HF tensors read, bytes read)."""
    from megatron_dapo import parallel
    from megatron_dapo.actor.hf_io import SafetensorsReader, load_hf_weights
    from megatron_dapo.actor.hf_mapping import stage_rules

    rules = stage_rules(spec, parallel.pp_rank(), parallel.pp_size())
    rules_total = sum(len(r.hf_names) for r in rules)
    stage = f"stage {parallel.pp_rank() + 1}/{parallel.pp_size()} " if parallel.pp_size() > 1 else ""
    with cc.progress(rules_total, f"{stage}HF -> Megatron", show) as bar:
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


def verify(args: argparse.Namespace, spec, out: Path) -> int:
    """Reload OUT into a fresh fp32 model at this layout; compare logits with transformers on one rank."""
    import torch
    import torch.distributed as dist

    from megatron_dapo import parallel

    model = cc.build_stage(spec, "float32", args.tp, args.pp)
    cc.load_weights_only(model, out)
    tokens = cc.verify_tokens(spec)
    logits = cc.megatron_logits(model, tokens, spec.vocab_size)
    del model
    result = torch.zeros(2, dtype=torch.float64)
    if logits is not None and parallel.tp_rank() == 0:
        result[:] = torch.tensor(cc.compare_logits(logits, cc.hf_logits(args.hf_dir, tokens)))
    dist.all_reduce(result)  # exactly one rank (last stage, TP rank 0) contributes
    diff, agree = result.tolist()
    if parallel.is_main():
        return cc.report_verify(PROG, diff, agree, tokens.numel(), args.tol,
                                f"(checkpoint reloaded at TP={args.tp} PP={args.pp} vs transformers)")
    return cc.EXIT_OK if diff <= args.tol else cc.EXIT_VERIFY_FAILED


if __name__ == "__main__":
    sys.exit(cc.run_cli(PROG, main))
