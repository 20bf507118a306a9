"""The paper's Table 1 on the tiny task (the runs and the table: megatron_dapo/ablation.py).

    python tools/ablate.py --seeds 1 2 3 --budget 20000 --out runs/ablation [--jobs 2] [overrides...]

With --jobs N, N runs go at once, each with one torch thread (OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from megatron_dapo.ablation import ROWS, AblationSettings, plot, run_one, table

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "examples/configs/tiny_cpu.yaml"))
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--budget", type=int, default=20000, help="responses generated per run")
    p.add_argument("--steps", type=int, default=1000, help="upper bound on steps (the budget stops first)")
    p.add_argument("--target", type=float, default=0.8, help="accuracy for the steps-to-target column")
    p.add_argument("--rows", type=int, nargs="+", default=list(range(len(ROWS))))
    p.add_argument("--out", default="runs/ablation")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (each then uses one torch thread)")
    p.add_argument("overrides", nargs="*", help="dotted overrides applied to every run")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.jobs < 1:
        p.error("--jobs must be >= 1")
    settings = AblationSettings(config=args.config, out=args.out, budget=args.budget, steps=args.steps,
                                target=args.target, jobs=args.jobs, overrides=tuple(args.overrides))

    def one(job: tuple[int, int]) -> dict:
        r = run_one(settings, *job)
        print(f"[ablate] {ROWS[r['row']][0]:<28} seed {r['seed']}: avg@k {r['start']:.3f} -> {r['final']:.3f} "
              f"({r['seconds']:.0f} s)", flush=True)
        return r

    jobs = [(row, seed) for row in args.rows for seed in args.seeds]
    print(f"[ablate] {len(jobs)} runs, {args.jobs} at a time", flush=True)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(one, jobs))
    md = table(results, args.seeds, args.target)
    (Path(args.out) / "table.md").write_text(md + "\n")
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, Path(args.out) / "ablation.png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
