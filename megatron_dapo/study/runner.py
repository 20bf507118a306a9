"""Running a study: every (variant, seed) as its own training process, `jobs` at a time, each leaving
its result in <out>/runs/<variant>_seed<seed>.json. A result on disk whose run command matches is not
run again, so a killed study continues where it stopped (an unfinished run restarts from its start)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_dapo.study.curves import TAGS, read_curves
from megatron_dapo.study.spec import Study, Variant

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, kw_only=True)
class Run:
    variant: Variant
    seed: int
    overrides: tuple[str, ...]
    """Everything the run's config gets after the study's config file, the variant's switches last but
    for the command line's own overrides."""
    context: str = ""
    """What else the run depends on (`inputs_digest`: the config file's text, the base model's weights)."""

    @property
    def name(self) -> str:
        return f"{self.variant.key}_seed{self.seed}"

    @property
    def fingerprint(self) -> str:
        """A hash of what the run computes (not where it writes): a changed setting reruns it."""
        return hashlib.sha256(json.dumps([self.context, *self.overrides]).encode()).hexdigest()[:16]


def plan(study: Study, extra: tuple[str, ...] = (), context: str = "") -> list[Run]:
    """Every run of `study`, seed-major (so the first runs already cover every variant)."""
    common = (*study.overrides, f"train.rollout_budget={study.budget}", f"train.steps={study.max_steps}")
    return [Run(variant=v, seed=s, overrides=(*common, *v.overrides, f"train.seed={s}", *extra), context=context)
            for s in study.seeds for v in study.variants]


def inputs_digest(study: Study, base: Path) -> str:
    """A hash of the study's config file and of the base model's weights: a stored result computed from
    another config text or another base is stale."""
    digest = hashlib.sha256(config_path(study).read_bytes())
    for weights in sorted(Path(base).glob("*.safetensors")):
        digest.update(weights.read_bytes())
    return digest.hexdigest()[:16]


def config_path(study: Study) -> Path:
    path = Path(study.config)
    return path if path.is_absolute() or path.exists() else REPO / path


def ensure_base(study: Study, extra: tuple[str, ...], seconds: float | None) -> Path:
    """The base model the study's runs start from (model.hf_dir), built there on first use."""
    from megatron_dapo.config import load_config

    hf_dir = load_config(str(config_path(study)), [*study.overrides, *extra]).model.hf_dir
    if study.base == "steps":
        from megatron_dapo.tiny.steps_base import ensure_steps_base

        return ensure_steps_base(hf_dir, seconds)
    if study.base == "tool":
        from megatron_dapo.tiny.tool_base import ensure_tool_base

        return ensure_tool_base(hf_dir, seconds)
    from megatron_dapo.tiny import Settings, ensure_tiny_base

    return ensure_tiny_base(hf_dir, Settings.seconds if seconds is None else seconds)


def check(study: Study, runs: list[Run]) -> None:
    """Every run's config loads and validates (raises ConfigError naming the key), before any work."""
    from megatron_dapo.config import load_config, validate

    for run in runs:
        validate(load_config(str(config_path(study)), list(run.overrides)), 1)


def result_path(out: Path, run: Run) -> Path:
    return out / "runs" / f"{run.name}.json"


def load_done(out: Path, run: Run) -> dict[str, Any] | None:
    """The stored result of `run`, or None when it is missing or was computed with other settings."""
    path = result_path(out, run)
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    return result if result.get("fingerprint") == run.fingerprint else None


def command(study: Study, run: Run, out: Path) -> list[str]:
    return [sys.executable, "-m", "megatron_dapo.train", "--config", str(config_path(study)), *run.overrides,
            f"logging.tensorboard_dir={out / 'tb'}", f"logging.run_name={run.name}",
            f"checkpoint.dir={out / 'ckpt'}", "checkpoint.save_every=0", "checkpoint.export_hf=false",
            "checkpoint.resume=none"]


def run_one(study: Study, run: Run, out: Path, *, threads: int | None) -> dict[str, Any]:
    """Train one run from scratch (its old logs removed), then store and return its curves."""
    logdir, ckpt, log = out / "tb" / run.name, out / "ckpt" / run.name, out / "logs" / f"{run.name}.log"
    for stale in (logdir, ckpt):
        shutil.rmtree(stale, ignore_errors=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
    t0 = time.time()
    with log.open("w") as handle:
        proc = subprocess.run(command(study, run, out), stdout=handle, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        tail = log.read_text()[-2000:]
        raise RuntimeError(f"run {run.name} failed (exit {proc.returncode}; log {log}):\n{tail}")
    result = {"variant": run.variant.key, "label": run.variant.label, "seed": run.seed,
              "overrides": list(run.overrides), "fingerprint": run.fingerprint,
              "seconds": round(time.time() - t0, 1), "curves": read_curves(logdir, TAGS)}
    path = result_path(out, run)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result) + "\n")
    tmp.replace(path)  # atomic: a result file present is complete
    shutil.rmtree(ckpt, ignore_errors=True)
    return result


def run_all(study: Study, out: Path, runs: list[Run], *, jobs: int, progress: bool = True) -> list[dict[str, Any]]:
    """Every run of `runs` not already done, `jobs` at a time (one torch thread each when jobs > 1), with
    a progress bar and an ETA; returns all results (stored ones included) in `runs` order. Raises after
    the others finish if a run failed."""
    from tqdm import tqdm

    done = {r.name: res for r in runs if (res := load_done(out, r)) is not None}
    todo = [r for r in runs if r.name not in done]
    bar = tqdm(total=len(runs), initial=len(done), unit="run", desc=study.name, disable=not progress,
               dynamic_ncols=True, mininterval=1.0, smoothing=0.0)
    lock, failed = threading.Lock(), []
    with bar, ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_one, study, r, out, threads=1 if jobs > 1 else None): r for r in todo}
        for future in as_completed(futures):
            run = futures[future]
            try:
                done[run.name] = result = future.result()
            except RuntimeError as e:
                failed.append(str(e))
                continue
            with lock:
                bar.update(1)
                bar.write(f"[{study.name}] {run.name}: {summary_line(result)} ({result['seconds']:.0f} s)")
    if failed:
        raise RuntimeError(f"{len(failed)} run(s) failed:\n" + "\n".join(failed))
    return [done[r.name] for r in runs]


def summary_line(result: dict[str, Any]) -> str:
    acc = result["curves"].get("val/acc_avg_at_k", [])
    return f"val acc {acc[0][1]:.3f} -> {acc[-1][1]:.3f}" if acc else "no validation points"
