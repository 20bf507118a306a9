"""TensorBoard scalars (the paper's §4.3 dashboard), alarms, an end-of-run PNG of the dynamics, phase timers
and the progress bar; optionally the same scalars and samples mirrored to W&B (wandb_mirror.py)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_dapo.config import LoggingConfig, WandbConfig

log = logging.getLogger(__name__)

SUMMARY_CURVES = ("response_length/mean", "train/reward_mean", "actor/entropy", "actor/mean_token_prob",
                  "val/acc_avg_at_k")
PLOTTED = SUMMARY_CURVES + ("rollout/kept_group_frac",)


@dataclass
class Alarms:
    """Entropy collapse, length blow-up, non-finite loss and a step without one correct answer, each
    raised as a warning and an `alarm/*` scalar.

    no_correct_answers: accuracy 0 in every group of the step. With the soft overlong penalty such
    groups still differ in reward, so DAPO would then train on response length alone."""

    cfg: LoggingConfig
    max_response_len: int
    first_entropy: float | None = None
    raised: set[str] = field(default_factory=set)

    def check(self, scalars: dict[str, float]) -> dict[str, float]:
        out = {}
        ent = scalars.get("actor/entropy")
        if ent is not None and math.isfinite(ent):
            self.first_entropy = ent if self.first_entropy is None else self.first_entropy
            out["alarm/entropy_collapse"] = float(ent < self.cfg.entropy_collapse_frac * self.first_entropy)
        length = scalars.get("response_length/mean")
        if length is not None:
            out["alarm/length_blowup"] = float(length > self.cfg.length_blowup_frac * self.max_response_len)
        out["alarm/nonfinite_loss"] = float(scalars.get("actor/nonfinite", 0.0) > 0)
        acc = scalars.get("train/acc_mean")
        if acc is not None:
            out["alarm/no_correct_answers"] = float(acc == 0.0)
        for name, on in out.items():
            if on and name not in self.raised:
                log.warning("ALARM %s: %s", name, {k: v for k, v in scalars.items() if k.split("/")[0] in
                                                    ("actor", "response_length", "train")})
            (self.raised.add if on else self.raised.discard)(name)
        return out

    def state_dict(self) -> dict:
        return {"first_entropy": self.first_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.first_entropy = state.get("first_entropy")


class MetricsWriter:
    """Writes scalars on the main rank only; keeps the history for the summary plot. With `wandb` enabled
    the same scalars and samples, and `run_config`, also go to a W&B run named after the folder."""

    def __init__(self, logdir: str | Path, enabled: bool = True, *, wandb: WandbConfig | None = None,
                 run_config: dict[str, Any] | None = None):
        self.logdir = Path(logdir)
        self.enabled = enabled
        self.history: dict[str, dict[int, float]] = defaultdict(dict)
        """tag -> step -> value (a replayed step overwrites)."""
        self._writer = None
        self._wandb = None
        self._sample_steps: set[int] = set()
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.logdir.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(str(self.logdir))
            if wandb is not None and wandb.enabled:
                from megatron_dapo.wandb_mirror import WandbMirror

                self._wandb = WandbMirror(wandb, self.logdir, self.logdir.name, run_config or {})

    def write(self, step: int, scalars: dict[str, float]) -> None:
        if not self.enabled:
            return
        for tag, value in scalars.items():
            value = float(value)
            self._writer.add_scalar(tag, value, step)
            self.history[tag][step] = value
        self._writer.flush()
        if self._wandb is not None:
            self._wandb.log(step, {tag: float(v) for tag, v in scalars.items()})

    def write_samples(self, step: int, split: str, records: list[dict[str, Any]], text_count: int = 4) -> Path | None:
        """Records as JSON lines in samples/step_<step>.jsonl (a step's first write in this process
        replaces the file, a later one appends), the first `text_count` as TensorBoard text."""
        if not self.enabled or not records:
            return None
        folder = self.logdir / "samples"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"step_{step}.jsonl"
        with path.open("a" if step in self._sample_steps else "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        self._sample_steps.add(step)
        text = "\n\n---\n\n".join(
            f"**prompt** ({r['uid']}, truth {r['ground_truth']}):\n```\n{r['prompt']}\n```\n"
            f"**response** (reward {r['reward']:.3f}, acc {int(r['acc'])}, {r['length']} tokens):\n"
            f"```\n{r['response']}\n```" for r in records[:text_count])
        self._writer.add_text(f"samples/{split}", text, step)
        self._writer.flush()
        if self._wandb is not None:
            self._wandb.log_samples(step, split, records)
        return path

    def load_history(self, until_step: int) -> None:
        """After a resume: take the plotted curves up to `until_step` from the run's earlier event files,
        so the summary covers the whole run, not only the steps since the resume."""
        if not self.enabled:
            return
        for tag, points in read_scalars(self.logdir, PLOTTED).items():
            self.history[tag].update({step: v for step, v in points.items() if step <= until_step})

    def summary_png(self, path: str | Path | None = None) -> Path | None:
        """A 2x3 grid of the dynamics the paper monitors (§4.3), next to the event files."""
        if not self.enabled or not self.history:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(2, 3, figsize=(13, 7))
        for ax, tag in zip(axes.flat, PLOTTED):
            points = sorted(self.history.get(tag, {}).items())
            if points:
                ax.plot(*zip(*points), marker="." if len(points) < 50 else None)
            ax.set_title(tag)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        out = Path(path) if path else self.logdir / "summary.png"
        fig.savefig(out, dpi=90)
        plt.close(fig)
        return out

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            self._wandb.finish()


def _event_files(logdir: str | Path, kind: str) -> Iterator[Any]:
    """A loaded EventAccumulator (all its `kind` events kept) per TensorBoard event file in `logdir`, in the
    order the files were written. An event file being written by a live run is read as far as it goes."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for f in sorted(Path(logdir).glob("events.out.tfevents.*"), key=lambda p: (p.stat().st_mtime, p.name)):
        ea = EventAccumulator(str(f), size_guidance={kind: 0})
        ea.Reload()
        yield ea


def read_scalars(logdir: str | Path, tags: Iterable[str] | None = None) -> dict[str, dict[int, float]]:
    """tag -> step -> value from the TensorBoard event files in `logdir` (only `tags`, if given), read in the
    order they were written: a step a resumed run wrote again has its last value. An event file being
    written by a live run is read as far as it goes."""
    wanted = None if tags is None else set(tags)
    out: dict[str, dict[int, float]] = {}
    for ea in _event_files(logdir, "scalars"):
        for tag in ea.Tags()["scalars"]:
            if wanted is None or tag in wanted:
                out.setdefault(tag, {}).update({e.step: e.value for e in ea.Scalars(tag)})
    return out


def read_texts(logdir: str | Path) -> dict[str, dict[int, str]]:
    """tag -> step -> text of the TensorBoard text summaries in `logdir` (e.g. write_samples' `samples/val`),
    the last value written winning as in read_scalars."""
    out: dict[str, dict[int, str]] = {}
    for ea in _event_files(logdir, "tensors"):
        for tag in ea.Tags()["tensors"]:
            if tag.endswith("/text_summary"):
                out.setdefault(tag.removesuffix("/text_summary"), {}).update(
                    {e.step: e.tensor_proto.string_val[0].decode("utf-8") for e in ea.Tensors(tag)})
    return out


class PhaseTimer:
    """Wall time per named phase of a step (`with timer("rollout"): ...`); `take()` returns and resets."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] += time.perf_counter() - t0

    def move(self, src: str, dst: str, seconds: float) -> None:
        """Re-attribute `seconds` of phase `src` to `dst` (e.g. reward scoring inside the rollout)."""
        self._seconds[src] -= seconds
        self._seconds[dst] += seconds

    def take(self) -> dict[str, float]:
        out = dict(self._seconds)
        self._seconds.clear()
        return out


def progress(steps: range, enabled: bool) -> Any:
    """A tqdm bar over `steps` on the driver rank; the plain range elsewhere."""
    if not enabled:
        return steps
    from tqdm import tqdm

    return tqdm(steps, desc="dapo", unit="step", initial=0, total=len(steps), dynamic_ncols=True)
