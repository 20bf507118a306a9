"""Hugging Face (Qwen2 / Qwen2.5 / Llama / Qwen3 / Qwen3-MoE / Qwen2-MoE safetensors) -> Megatron distributed checkpoint.

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
heads / KV heads / FFN (and expert FFN) sizes, PP divides the layers, the output folder empty (or --force).
`--verify` reloads the written checkpoint into a fresh fp32 model at this layout and compares its
logits on a fixed token batch with transformers' (max |diff| <= --tol, default 1e-4).

Exit codes: 0 done (and verified), 1 verification failed, 2 invalid input or refused.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from megatron_dapo.actor import convert
from megatron_dapo.actor.convert_checks import USER_ERRORS
from megatron_dapo.cli import UserError, preflight_error, quiet_third_party, run_cli
from megatron_dapo.parallel import free_port, launch_env

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


def main(argv: list[str] | None = None) -> int:
    _die_with_parent()
    args = parse_args(argv)
    quiet_third_party()
    cfg = convert.ToMegatron(**vars(args))
    world, wanted = launch_env().world_size, args.tp * args.pp
    if world == 1 and wanted > 1:
        convert.preflight_to_megatron(cfg)  # fail fast, in this process, before starting ranks
        return spawn_ranks(wanted, sys.argv[1:] if argv is None else argv)
    if world != wanted:
        raise preflight_error(UserError(
            f"started as {world} ranks but --tp {args.tp} x --pp {args.pp} = {wanted}: start exactly "
            f"{wanted} ranks, or start the tool as one process and it starts them"))
    return convert.hf_to_megatron(cfg, PROG)


def spawn_ranks(n: int, argv: list[str]) -> int:
    """Start n local ranks of this script (torchrun's environment) and wait; a failed rank stops the rest."""
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
    return 0


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


if __name__ == "__main__":
    sys.exit(run_cli(PROG, main, user_errors=USER_ERRORS))
