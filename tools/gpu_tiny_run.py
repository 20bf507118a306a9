"""The tiny DAPO job end to end as a GPU would run it: one process, the embedded engine colocated with the
actor (which offloads while the engine generates), bf16, the weight-sync probe on, a checkpoint after every
step; prints ONE JSON line: exit status, wall time, per-step probe and rollout/train logprob gap, and the
last step's phase ledger (on CUDA beside torch's allocated / reserved bytes and the device's used memory).

    python tools/gpu_tiny_run.py --out DIR [--steps 3] [--base-seconds 20]

The GPU check's `tiny_dapo` stage (tools/gpu_check.sh); on a CPU it runs the same job (the bf16 CPU tier).
The tiny base is built into DIR (a few seconds of warm-start: the job's learning is not what is checked).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train_command(base: Path, out: Path, steps: int) -> list[str]:
    config = REPO / "examples/configs/tiny_cpu.yaml"
    return [sys.executable, "-m", "megatron_dapo.train", "--config", str(config), f"model.hf_dir={base}",
            "model.dtype=bfloat16", "rollout.colocate=true", "actor.offload_when_idle=true",
            "rollout.weight_sync_probe=true", f"train.steps={steps}", "checkpoint.save_every=1",
            "checkpoint.export_hf=true", f"checkpoint.dir={out / 'ckpt'}", f"logging.tensorboard_dir={out / 'tb'}",
            "logging.run_name=gpu_tiny", "train.prompt_batch_size=8", "train.mini_batch_size=4",
            "algo.group_size=4", "algo.filter_metric=score", f"eval.every_steps={steps}", "eval.max_prompts=32"]


def summary(tb: dict[str, dict[int, float]], rc: int, wall: float, tail: str) -> dict:
    steps = sorted(tb.get("timing/step_s", {}))
    last = steps[-1] if steps else None
    per_step = {tag: {s: round(v, 6) for s, v in tb.get(tag, {}).items()}
                for tag in ("rollout/weight_sync_probe_absdiff", "rollout/train_rollout_logprob_absdiff",
                            "timing/step_s", "perf/weight_sync_bytes")}
    ledger = {tag: values[last] for tag, values in tb.items() if tag.startswith("memory/") and last in values}
    return {"rc": rc, "wall_s": round(wall, 1), "steps": steps, **per_step, "ledger": ledger,
            "val_acc": tb.get("val/acc_avg_at_k", {}), **({"stderr_tail": tail} if rc else {})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--base-seconds", type=float, default=20.0)
    args = p.parse_args(argv)
    from megatron_dapo.metrics import read_scalars
    from megatron_dapo.tiny import ensure_tiny_base

    base = ensure_tiny_base(args.out / "tiny_base", seconds=args.base_seconds)
    t0 = time.perf_counter()
    r = subprocess.run(train_command(base, args.out, args.steps), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    tb = read_scalars(args.out / "tb" / "gpu_tiny")
    print(json.dumps(summary(tb, r.returncode, wall, r.stderr[-2000:])))
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
