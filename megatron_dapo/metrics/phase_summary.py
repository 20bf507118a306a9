"""One line per phase of a finished (short) run, from its TensorBoard scalars and checkpoint folder: the first-contact
check of examples/run_dapo_32b.sh (FIRST_CONTACT=1). A phase that left no trace fails it (exit 1).

    python -m megatron_dapo.metrics.phase_summary --logdir runs/NAME --checkpoints checkpoints/NAME
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from megatron_dapo.metrics.events import read_scalars

PHASES = (  # name, the timing that proves it ran, what else the line shows (tag, label: its last value, or the
    # largest for "max"), the ledger's phase
    ("generate", "timing/rollout_s", (("response_length/mean", "response length"),), "generate"),
    ("pi_old", "timing/old_logprob_s", (), None),
    ("train", "timing/update_s", (("train/reward_mean", "reward"),), "train"),
    ("sync", "timing/weight_sync_s", (("rollout/weight_sync_probe_absdiff", "probe |diff| max"),
                                      ("perf/weight_sync_bytes", "bytes")), "sync"),
    ("eval", "timing/eval_s", (("val/acc_avg_at_k", "acc"),), None),
)


def _max(series: dict[int, float]) -> float:
    return max(series.values())


def _shown(series: dict[int, float], label: str) -> float:
    return _max(series) if label.endswith(" max") else series[max(series)]


def phase_lines(scalars: dict[str, dict[int, float]], checkpoints: Path | None) -> tuple[list[str], bool]:
    """(the lines, whether every phase ran)."""
    lines, ok = [], True
    for name, timing, extra, ledger in PHASES:
        series = scalars.get(timing)
        if not series:
            lines.append(f"phase {name}: NOT RUN (no {timing})")
            ok = False
            continue
        parts = [f"{len(series)} step(s)", f"{sum(series.values()) / len(series):.1f} s mean"]
        parts += [f"{label} {_shown(scalars[tag], label):.4g}" for tag, label in extra if scalars.get(tag)]
        used = scalars.get(f"memory/device_used_{ledger}") if ledger else None
        if used:
            parts.append(f"device used {_max(used) / 2**30:.1f} GiB")
        lines.append(f"phase {name}: ok, " + ", ".join(parts))
    if checkpoints is not None:
        saved = sorted(p.name for p in checkpoints.glob("step_*") if p.is_dir())
        if saved:
            hf = " + hf_final" if (checkpoints / "hf_final").is_dir() else ""
            lines.append(f"phase checkpoint: ok, {len(saved)} saved ({saved[-1]} newest){hf} in {checkpoints}")
        else:
            lines.append(f"phase checkpoint: NOT RUN (no step_* in {checkpoints})")
            ok = False
    return lines, ok


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--logdir", required=True, help="the run's TensorBoard folder (<tensorboard_dir>/<run_name>)")
    ap.add_argument("--checkpoints", help="the run's checkpoint folder (<checkpoint.dir>/<run_name>)")
    args = ap.parse_args(argv)
    if not Path(args.logdir).is_dir():
        print(f"phase summary: no TensorBoard folder {args.logdir}", file=sys.stderr)
        return 1
    lines, ok = phase_lines(read_scalars(args.logdir), Path(args.checkpoints) if args.checkpoints else None)
    print("\n".join(lines))
    print("first contact: every phase ran" if ok else "first contact: a phase did not run (above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
