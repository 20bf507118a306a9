"""The paper's Table 1 on the tiny task: naive GRPO -> +overlong filtering -> +clip-higher ->
+soft overlong punishment -> +token-level loss -> +dynamic sampling (DAPO), several seeds each, at an
equal rollout budget (responses generated). Writes a markdown table (mean ± std of the final
avg@k accuracy and of the steps to reach a target accuracy) and a plot.

The runs and the reporting; the command line is tools/ablate.py:

    python tools/ablate.py --seeds 1 2 3 --budget 20000 --out runs/ablation [--jobs 2] [overrides...]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Each row adds one technique to the previous one (Table 1 is cumulative).
ROWS: list[tuple[str, list[str]]] = [
    ("naive GRPO", ["algo.eps_high=0.2", "algo.loss_agg_mode=seq-mean-token-mean", "algo.overlong_filtering=false",
                    "reward.soft_overlong_punishment=false", "algo.dynamic_sampling=false"]),
    ("+ overlong filtering", ["algo.overlong_filtering=true"]),
    ("+ clip-higher", ["algo.eps_high=0.28"]),
    ("+ soft overlong punishment", ["reward.soft_overlong_punishment=true"]),
    ("+ token-level loss", ["algo.loss_agg_mode=token-mean"]),
    ("+ dynamic sampling (DAPO)", ["algo.dynamic_sampling=true"]),
]


def row_overrides(index: int) -> list[str]:
    """Overrides of row `index`: every delta up to it, later ones winning."""
    merged: dict[str, str] = {}
    for _, delta in ROWS[: index + 1]:
        merged.update(dict(o.split("=", 1) for o in delta))
    return [f"{k}={v}" for k, v in merged.items()]


def read_curve(logdir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    points: dict[int, float] = {}
    for f in sorted(logdir.glob("events.out.tfevents.*")):
        ea = EventAccumulator(str(f))
        ea.Reload()
        if tag in ea.Tags()["scalars"]:
            points.update({e.step: e.value for e in ea.Scalars(tag)})
    return sorted(points.items())


@dataclass(frozen=True, kw_only=True)
class AblationSettings:
    config: str
    out: str
    budget: int
    """Responses generated per run (the equal rollout budget)."""
    steps: int
    """Upper bound on steps (the budget stops first)."""
    target: float
    """Accuracy for the steps-to-target column."""
    jobs: int = 1
    """Runs at once; each then uses one torch thread."""
    overrides: tuple[str, ...] = ()
    """Dotted overrides applied to every run."""


def run_one(args: AblationSettings, row: int, seed: int) -> dict:
    name = f"row{row}_seed{seed}"
    logdir = Path(args.out) / "tb"
    cmd = [sys.executable, "-m", "megatron_dapo.train", "--config", args.config, *row_overrides(row),
           f"train.seed={seed}", f"train.rollout_budget={args.budget}", f"train.steps={args.steps}",
           f"logging.tensorboard_dir={logdir}", f"logging.run_name={name}",
           f"checkpoint.dir={Path(args.out) / 'ckpt'}", "checkpoint.save_every=0", "checkpoint.export_hf=false",
           "checkpoint.resume=none", *args.overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if args.jobs > 1 else None
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    curve = read_curve(logdir / name, "val/acc_avg_at_k")
    hit = next((s for s, v in curve if v >= args.target), None)
    return {"row": row, "seed": seed, "final": curve[-1][1], "start": curve[0][1], "steps_to_target": hit,
            "curve": curve, "seconds": time.time() - t0}


def mean_std(values: list[float]) -> str:
    if not values:
        return "n/a"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f}"


def table(results: list[dict], seeds: list[int], target: float) -> str:
    lines = [f"| technique | final avg@k | steps to {target:.2f} (reached/seeds) |", "|---|---|---|"]
    for i, (label, _) in enumerate(ROWS):
        rs = [r for r in results if r["row"] == i]
        hits = [r["steps_to_target"] for r in rs if r["steps_to_target"] is not None]
        lines.append(f"| {label} | {mean_std([r['final'] for r in rs])} | "
                     f"{mean_std([float(h) for h in hits])} ({len(hits)}/{len(seeds)}) |")
    return "\n".join(lines)


def plot(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (label, _) in enumerate(ROWS):
        for k, r in enumerate(r for r in results if r["row"] == i):
            ax.plot(*zip(*r["curve"]), color=f"C{i}", alpha=0.7, label=label if k == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("val avg@k accuracy")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
