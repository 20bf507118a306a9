"""A study's report from its results: the table (mean ± std over seeds), the single-switch contrasts
(paired by seed), the figure of the paper's panels, and the JSON of every curve."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megatron_dapo.study.curves import at, first_reaching
from megatron_dapo.study.spec import Study

ACC, ENTROPY, LENGTH, KEPT = "val/acc_avg_at_k", "actor/entropy", "response_length/mean", "rollout/kept_group_frac"
SAMPLES, TRUNC = "rollout/samples_total", "response_length/clip_ratio"
LATE = 3
"""Per-step monitors are reported as the mean of a run's last LATE steps (one step is noisy)."""


def mean_std(values: Sequence[float], digits: int = 3) -> str:
    if not values:
        return "n/a"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"


def late(curve: list[list[float]]) -> float:
    tail = [v for _, v in curve[-LATE:]]
    return sum(tail) / len(tail) if tail else float("nan")


def run_summary(result: dict[str, Any], target: float, extra: Sequence[str] = ()) -> dict[str, Any]:
    """One run's numbers: start / final validation accuracy, when it reached `target` (step and
    responses generated), its late entropy, length, truncated fraction, steps run, and the late mean of
    every tag of `extra` (under the tag)."""
    c = result["curves"]
    acc, samples = c.get(ACC, []), c.get(SAMPLES, [])
    hit = first_reaching(acc, target)
    return {"start": acc[0][1] if acc else float("nan"), "final": acc[-1][1] if acc else float("nan"),
            "steps_to_target": hit, "responses_to_target": (at(samples, hit) or 0.0) if hit is not None else None,
            "entropy": late(c.get(ENTROPY, [])), "length": late(c.get(LENGTH, [])), "truncated": late(c.get(TRUNC, [])),
            "steps": int(acc[-1][0]) if acc else 0, **{tag: late(c.get(tag, [])) for tag in extra}}


def _late_tags(study: Study) -> list[str]:
    return [tag for tag, _ in study.late]


def _by_variant(study: Study, results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {v.key: [] for v in study.variants}
    for r in results:
        groups.setdefault(r["variant"], []).append({**run_summary(r, study.target, _late_tags(study)), "seed": r["seed"]})
    return groups


def table(study: Study, results: list[dict[str, Any]]) -> str:
    """Markdown: one row per variant, mean ± std over its seeds."""
    t = f"{study.target:.2f}"
    more = "".join(f" {label} (late) |" for _, label in study.late)
    lines = [f"| variant | val acc start | val acc final | steps to {t} (reached) | responses to {t} | "
             f"entropy (late) | length (late) | truncated (late) | steps |{more}",
             "|---|---|---|---|---|---|---|---|---|" + "---|" * len(study.late)]
    groups = _by_variant(study, results)
    for v in study.variants:
        rs = groups[v.key]
        hits = [r for r in rs if r["steps_to_target"] is not None]

        def col(key: str, digits: int = 3, rows: list = rs) -> str:
            return mean_std([float(r[key]) for r in rows], digits)
        lines.append(f"| {v.label} | {col('start')} | {col('final')} | {col('steps_to_target', 1, hits)} "
                     f"({len(hits)}/{len(rs)}) | {col('responses_to_target', 0, hits)} | {col('entropy')} | "
                     f"{col('length', 1)} | {col('truncated')} | {col('steps', 1)} |"
                     + "".join(f" {col(tag)} |" for tag in _late_tags(study)))
    return "\n".join(lines)


def contrasts(study: Study, results: list[dict[str, Any]]) -> str:
    """Markdown: each contrast's on - off difference per seed (paired), mean ± std."""
    groups = _by_variant(study, results)
    more = "".join(f" Δ {label} (late) |" for _, label in study.late)
    lines = [f"| contrast | Δ val acc final | Δ entropy (late) | Δ length (late) | Δ steps run |{more} seeds |",
             "|---|---|---|---|---|---|" + "---|" * len(study.late)]
    for c in study.contrasts:
        off = {r["seed"]: r for r in groups.get(c.off, [])}
        on = {r["seed"]: r for r in groups.get(c.on, [])}
        cols = [_paired_delta(on, off, key, digits) for key, digits in (("final", 3), ("entropy", 3),
                                                                        ("length", 1), ("steps", 1),
                                                                        *((tag, 3) for tag in _late_tags(study)))]
        lines.append(f"| {c.label} | {' | '.join(cols)} | {len(on.keys() & off.keys())} |")
    return "\n".join(lines)


def _paired_delta(on: dict[int, dict[str, Any]], off: dict[int, dict[str, Any]], key: str, digits: int) -> str:
    """mean ± std over the seeds both sides ran of on[seed][key] - off[seed][key]."""
    return mean_std([float(on[s][key]) - float(off[s][key]) for s in sorted(on.keys() & off.keys())], digits)


def write_json(study: Study, results: list[dict[str, Any]], path: Path, **extra: Any) -> None:
    """Every curve of every run, with the study's definition and each run's summary."""
    doc = {"study": study.name, "config": study.config, "seeds": list(study.seeds), "budget": study.budget,
           "target": study.target, **extra,
           "variants": [{"key": v.key, "label": v.label, "overrides": list(v.overrides)} for v in study.variants],
           "contrasts": [{"label": c.label, "off": c.off, "on": c.on} for c in study.contrasts],
           "runs": [{**r, "summary": run_summary(r, study.target, _late_tags(study))} for r in results]}
    path.write_text(json.dumps(doc, indent=1) + "\n")


PANELS = [(ACC, "step", "validation accuracy (avg@k)"), (ACC, SAMPLES, "validation accuracy (avg@k)"),
          (ENTROPY, "step", "actor entropy (nats/token)"), (LENGTH, "step", "mean response length (tokens)"),
          (KEPT, "step", "kept-group fraction (0 < correct < G)"), (TRUNC, "step", "truncated fraction")]


def _xy(result: dict[str, Any], tag: str, x: str) -> tuple[list[float], list[float]]:
    curve = result["curves"].get(tag, [])
    if x == "step":
        return [s for s, _ in curve], [v for _, v in curve]
    samples = dict((int(s), v) for s, v in result["curves"].get(x, [])) | {0: 0.0}
    pts = [(samples[int(s)] / 1000, v) for s, v in curve if int(s) in samples]
    return [p[0] for p in pts], [p[1] for p in pts]


def _seed_mean(xys: list[tuple[list[float], list[float]]]) -> tuple[list[float], list[float]]:
    """Mean over seeds at each x that every seed has; where the seeds share no x (responses generated under
    dynamic sampling differ per seed), at every seed's x inside the range all seeds cover, each seed
    interpolated linearly there."""
    if not xys:
        return [], []
    common = sorted(set.intersection(*(set(x) for x, _ in xys)))
    if len(common) >= 2 or len(xys) == 1:
        return common, [statistics.mean(dict(zip(x, y))[c] for x, y in xys) for c in common]
    lo, hi = max(x[0] for x, _ in xys), min(x[-1] for x, _ in xys)
    grid = sorted({c for x, _ in xys for c in x if lo <= c <= hi})
    return grid, [statistics.mean(float(np.interp(c, x, y)) for x, y in xys) for c in grid]


def plot(study: Study, results: list[dict[str, Any]], path: Path) -> None:
    """The paper's panels, one line per variant (the mean over seeds; each seed faint)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (tag, x, ylabel) in zip(axes.flat, study.panels or PANELS):
        for i, v in enumerate(study.variants):
            style = dict(color=f"C{i}", linestyle="--" if i >= 6 else "-")
            xys = [_xy(r, tag, x) for r in results if r["variant"] == v.key]
            xys = [xy for xy in xys if xy[0]]
            for xs, ys in xys:
                ax.plot(xs, ys, alpha=0.2, linewidth=0.8, **style)
            ax.plot(*_seed_mean(xys), linewidth=1.8, label=v.label, **style)
        ax.set_xlabel("step" if x == "step" else "responses generated (thousands)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    seeds = ", ".join(map(str, study.seeds))
    fig.suptitle(f"{study.name}: mean over seeds {seeds} (faint: each seed); {study.budget} responses per run")
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
