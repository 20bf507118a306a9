"""Off-policy pipelining measured: the same DAPO work synchronous (engine on its own devices, no overlap) and
with `rollout.async_steps=1`, wall per step, each side's idle time and tokens/s, beside the limit.

Both runs are `python -m megatron_dapo.train` on the same base, prompts, groups and updates (seeded), with
`rollout.colocate=false`, in one session; torch gets --threads threads. The engine is on its own cores in
both runs, as on its own GPUs: the embedded engine runs in a process of its own with half of the threads
(rollout/embedded/process_engine.py), the actor keeps the other half, and in the synchronous run each side idles
while the other works. Bases: tiny (0.6M parameters), steps (the study's longer responses; built in up to 15
minutes, kept with --bases-dir) and smollm2 (SmolLM2-135M's architecture with --smollm2-layers layers, random weights, the
SmolLM2 recipe on built-in arithmetic prompts: a size where the kernels, not Python, take the time).
Steps 2 to --steps - (the largest K) are compared: a pipelined run's first step has nothing to overlap with, its last
K nothing left to produce (the engine idles through them). --async-steps K [K ...] runs a pipelined run for
each K against the one synchronous run, --modes batch stream one for each rollout.async_mode (fully async
needs the group stream: with stream among the modes every run streams, the synchronous one too). The limit of overlapping two
phases of times g (generation + reward) and t (the rest of the step) is max(g, t) / (g + t), from the
synchronous run's own phase times.

    python tools/bench_async.py --json                      # the tiny base, then the steps base, embedded
    python tools/bench_async.py --bases tiny --engines sglang --steps 4
    python tools/bench_async.py --bases smollm2 --smollm2-layers 4 --steps 4 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIZE = ["train.prompt_batch_size=16", "train.mini_batch_size=8", "algo.group_size=8"]
BASES = {
    # base -> (how to build it, the config, overrides that size the work)
    "tiny": ("megatron_dapo.tiny:ensure_tiny_base", "examples/configs/tiny_cpu.yaml", SIZE),
    "steps": ("megatron_dapo.tiny.steps_base:ensure_steps_base", "examples/configs/study_dapo_small.yaml", SIZE),
    "smollm2": ("megatron_dapo.tiny.chat:save_smollm2_shaped", "examples/configs/smollm2_135m_instruct.yaml",
                ["data.train_path=builtin:arithmetic?n=256&seed=0&style=instruct", "data.val_path=null",
                 "train.prompt_batch_size=4", "train.mini_batch_size=4", "algo.group_size=8",
                 "algo.dynamic_sampling=false", "rollout.max_response_len=64", "reward.overlong_cache_len=16"]),
}
COMMON = ["eval.every_steps=0", "checkpoint.save_every=0", "checkpoint.export_hf=false", "rollout.colocate=false",
          "train.rollout_budget=0", "logging.samples_every=0", "rollout.weight_sync_probe=false"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bases", nargs="+", default=["tiny", "steps"], choices=list(BASES))
    p.add_argument("--engines", nargs="+", default=["embedded"], choices=["embedded", "sglang"])
    p.add_argument("--steps", type=int, default=6,
                   help="steps a run (2 .. steps - max(--async-steps) compared; at least 2 + that)")
    p.add_argument("--async-steps", nargs="+", type=int, default=[1], metavar="K",
                   help="the pipelined runs' rollout.async_steps, each compared with the synchronous run")
    p.add_argument("--modes", nargs="+", default=["batch"], choices=["batch", "stream"],
                   help="rollout.async_mode of the pipelined runs (stream: fully async), each against the synchronous")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides of both runs")
    p.add_argument("--smollm2-layers", type=int, default=4, help="decoder layers of the smollm2 base (SmolLM2: 30)")
    p.add_argument("--bases-dir", type=Path, default=None,
                   help="build the bases here, or reuse the ones built here before (default: a temporary folder)")
    p.add_argument("--base-seconds", type=float, default=None,
                   help="pre-training time of the tiny / steps base when built (default: its recipe's)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the trainer process (this machine: 2)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    return p


def build_base(name: str, root: Path, smollm2_layers: int, seconds: float | None = None) -> Path:
    module, _, func = BASES[name][0].partition(":")
    kwargs = f", layers={smollm2_layers}" if name == "smollm2" else "" if seconds is None else f", seconds={seconds}"
    code = f"from {module} import {func}; print({func}({str(root / name)!r}{kwargs}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    return Path(out.stdout.strip().splitlines()[-1])


def run(base: Path, name: str, engine: str, async_steps: int, args: argparse.Namespace, root: Path,
        mode: str = "batch") -> dict:
    """One training run; its per-step scalars (TensorBoard), steps 2 .. steps - 1."""
    from megatron_dapo.metrics import read_scalars

    run_name = f"{name}_{engine}_async{async_steps}_{mode}"
    cmd = [sys.executable, "-m", "megatron_dapo.train", "--config", str(REPO / BASES[name][1]),
           f"model.hf_dir={base}", f"checkpoint.dir={root / 'ckpt'}", f"logging.tensorboard_dir={root / 'tb'}",
           f"logging.run_name={run_name}", f"train.steps={args.steps}", f"rollout.engine={engine}",
           f"rollout.async_steps={async_steps}", f"rollout.async_mode={mode}", *COMMON, *BASES[name][2],
           *(["rollout.streaming=true"] if "stream" in args.modes else []), *args.set]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=3600)
    if r.returncode:
        raise RuntimeError(f"{run_name} failed:\n{r.stderr[-4000:]}")
    tb = read_scalars(root / "tb" / run_name)
    last = args.steps - max(args.async_steps)  # the last steps of a k-deep run have nothing left to produce
    return {tag: [v for step, v in sorted(values.items()) if 2 <= step <= last] for tag, values in tb.items()}


def median(tb: dict, tag: str) -> float:
    return statistics.median(tb[tag]) if tb.get(tag) else 0.0


def compare(name: str, engine: str, k: int, sync: dict, pipe: dict, mode: str = "batch") -> dict:
    gen = median(sync, "timing/rollout_s")  # generation and scoring (timing/reward_s is the scoring part)
    wall_sync, wall_async = median(sync, "timing/step_s"), median(pipe, "timing/step_s")
    train = max(wall_sync - gen, 0.0)
    return {"base": name, "engine": engine, "async_steps": k, "async_mode": mode, "sync_step_s": wall_sync, "async_step_s": wall_async,
            "ratio": wall_async / wall_sync if wall_sync else float("nan"),
            "limit": max(gen, train) / (gen + train) if gen + train else float("nan"),
            "sync_generate_s": gen, "sync_train_s": train,
            "sync_actor_idle_s": gen, "sync_engine_idle_s": train,
            "async_actor_idle_s": median(pipe, "timing/actor_idle_s"),
            "async_engine_idle_s": median(pipe, "timing/engine_idle_s"),
            "async_overlap_s": median(pipe, "timing/overlap_s"),
            "sync_weight_sync_s": median(sync, "timing/weight_sync_s"),
            "async_weight_sync_s": median(pipe, "timing/weight_sync_s"),
            "sync_tokens_per_s": median(sync, "perf/tokens_per_s"),
            "async_tokens_per_s": median(pipe, "perf/tokens_per_s"),
            "async_staleness_mean": median(pipe, "rollout/staleness_mean"),
            "async_weight_updates_in_batch": median(pipe, "rollout/weight_updates")}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    deepest = max(args.async_steps)
    if min(args.async_steps) < 1 or args.steps < 2 + deepest:
        raise SystemExit(f"--steps {args.steps} --async-steps {args.async_steps}: each K at least 1, --steps at least "
                         f"{2 + max(deepest, 1)} (steps 2 .. steps - max K are compared)")
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        root = Path(tmp)
        for name in args.bases:
            base = build_base(name, (args.bases_dir or root).resolve(), args.smollm2_layers,  # built in REPO
                              args.base_seconds)
            for engine in args.engines:
                sync = run(base, name, engine, 0, args, root)
                for k in args.async_steps:
                    for mode in args.modes:
                        pipe = run(base, name, engine, k, args, root, mode)
                        report(compare(name, engine, k, sync, pipe, mode), args.json)
    return 0


def report(row: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(row), flush=True)
    else:
        print(f"{row['base']:6s} {row['engine']:9s} k={row['async_steps']} {row['async_mode']} sync {row['sync_step_s']:.2f} s/step (generate "
              f"{row['sync_generate_s']:.2f} + train {row['sync_train_s']:.2f}), async "
              f"{row['async_step_s']:.2f} s/step: x{row['ratio']:.2f} (limit x{row['limit']:.2f}); "
              f"idle actor {row['async_actor_idle_s']:.2f} s, engine {row['async_engine_idle_s']:.2f} s; "
              f"tokens/s {row['sync_tokens_per_s']:.0f} -> {row['async_tokens_per_s']:.0f}; staleness "
              f"{row['async_staleness_mean']:.2f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
