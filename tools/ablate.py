"""Run an ablation study of DAPO's techniques: the paper's Table 1 and single-switch contrasts, several
seeds at an equal rollout budget, resumable; writes results.json (every curve of every run),
table.md and study.png (the paper's panels) into --out.

    python tools/ablate.py --study dapo-small --jobs 2                 # docs/study_dapo_small/README.md
    python tools/ablate.py --study tiny --jobs 2                       # Table 1 on the tiny task
    python tools/ablate.py --study dapo-small --seeds 1 --budget 512 --variants grpo dapo train.steps=2

The base model is built first if the config's model.hf_dir lacks it. A run whose result is in
<out>/runs/ is not run again (delete the folder, or change a setting, to rerun). With --jobs N, N runs
go at once, each with one torch thread. Overrides (section.key=value) apply to every run, last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from megatron_dapo.config import ConfigError
from megatron_dapo.study import STUDIES, Study
from megatron_dapo.study.report import contrasts, plot, table, write_json
from megatron_dapo.study.runner import check, ensure_base, inputs_digest, plan, run_all

EXIT_USAGE = 2


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--study", default="dapo-small", choices=sorted(STUDIES))
    p.add_argument("--out", help="output folder (default runs/study_<study>)")
    p.add_argument("--jobs", type=int, default=2, help="runs at once (each then uses one torch thread)")
    p.add_argument("--seeds", type=int, nargs="+", help="replace the study's seeds")
    p.add_argument("--budget", type=int, help="replace the study's rollout budget (responses per run)")
    p.add_argument("--target", type=float, help="replace the study's target accuracy")
    p.add_argument("--variants", nargs="+", help="run only these variants (keys, e.g. grpo dapo)")
    p.add_argument("--base-seconds", type=float, help="time limit of the base build, if one is needed")
    p.add_argument("overrides", nargs="*", help="section.key=value, applied to every run")
    return p.parse_args(argv)


def select(args: argparse.Namespace) -> Study | str:
    """The study the arguments ask for, or the message of what is wrong with them."""
    study = STUDIES[args.study]()
    if args.jobs < 1 or (args.budget is not None and args.budget < 1):
        return "--jobs and --budget must be >= 1"
    if bad := [o for o in args.overrides if "=" not in o]:
        return f"overrides must be section.key=value, got {bad}"
    keys = [v.key for v in study.variants]
    if args.variants and (unknown := sorted(set(args.variants) - set(keys))):
        return f"unknown variant(s) {unknown}; {args.study} has {keys}"
    variants = tuple(v for v in study.variants if not args.variants or v.key in args.variants)
    kept = {v.key for v in variants}
    return replace(study, variants=variants, seeds=tuple(args.seeds or study.seeds),
                   budget=args.budget or study.budget, target=args.target if args.target is not None else study.target,
                   contrasts=tuple(c for c in study.contrasts if {c.off, c.on} <= kept))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    study = select(args)
    if isinstance(study, str):
        print(f"error: {study}", file=sys.stderr)
        return EXIT_USAGE
    extra = tuple(args.overrides)
    runs = plan(study, extra)
    try:
        check(study, runs)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_USAGE
    out = Path(args.out or f"runs/study_{study.name}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    base = ensure_base(study, extra, args.base_seconds)
    base_seconds = time.time() - t0
    runs = plan(study, extra, inputs_digest(study, base))
    print(f"[{study.name}] {len(runs)} runs ({len(study.variants)} variants x {len(study.seeds)} seeds, "
          f"{study.budget} responses each), {args.jobs} at a time; results in {out}", flush=True)
    results = run_all(study, out, runs, jobs=args.jobs)
    wall = _add_wall_time(out, time.time() - t0)
    write_json(study, results, out / "results.json", wall_seconds=wall, jobs=args.jobs, overrides=list(extra))
    plot(study, results, out / "study.png")
    md = table(study, results) + ("\n\n" + contrasts(study, results) if study.contrasts else "")
    (out / "table.md").write_text(md + "\n")
    print(md)
    print(f"[{study.name}] wall time {wall / 60:.1f} min over all sessions (this one: base "
          f"{base_seconds / 60:.1f} min, total {(time.time() - t0) / 60:.1f} min); {out / 'study.png'}")
    return 0


def _add_wall_time(out: Path, seconds: float) -> float:
    """The study's wall time summed over the sessions that worked on `out` (kept in wall_time.json)."""
    path = out / "wall_time.json"
    sessions = json.loads(path.read_text()) if path.is_file() else []
    sessions.append(round(seconds, 1))
    path.write_text(json.dumps(sessions) + "\n")
    return sum(sessions)


if __name__ == "__main__":
    sys.exit(main())
