"""The run's scalars and samples to TensorBoard (the paper's §4.3 dashboard), optionally mirrored to W&B
(wandb_mirror.py), and an end-of-run PNG of the dynamics."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from megatron_dapo.config import WandbConfig
from megatron_dapo.metrics.events import read_scalars

SUMMARY_CURVES = ("response_length/mean", "train/reward_mean", "actor/entropy", "actor/mean_token_prob",
                  "val/acc_avg_at_k")
PLOTTED = SUMMARY_CURVES + ("rollout/kept_group_frac",)


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
        """The TensorBoard writer, opened at the first write: a run that dies while starting leaves no folder."""
        self._purge_step: int | None = None
        self._wandb = None
        self._sample_steps: set[int] = set()
        if enabled and wandb is not None and wandb.enabled:
            from megatron_dapo.wandb_mirror import WandbMirror

            self._wandb = WandbMirror(wandb, self.logdir, self.logdir.name, run_config or {})

    def _tensorboard(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.logdir.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(str(self.logdir), purge_step=self._purge_step)
        return self._writer

    def write(self, step: int, scalars: dict[str, float]) -> None:
        if not self.enabled:
            return
        tb = self._tensorboard()
        for tag, value in scalars.items():
            value = float(value)
            tb.add_scalar(tag, value, step)
            self.history[tag][step] = value
        tb.flush()
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
        self._tensorboard().add_text(f"samples/{split}", text, step)
        self._writer.flush()
        if self._wandb is not None:
            self._wandb.log_samples(step, split, records)
        return path

    def load_history(self, until_step: int) -> None:
        """After a resume: take the plotted curves up to `until_step` from the run's earlier event files,
        so the summary covers the whole run, not only the steps since the resume; TensorBoard is told to
        drop what the earlier run wrote after `until_step` (its purge_step), so a redone step shows once."""
        if not self.enabled:
            return
        if self._writer is not None:  # (written before the resume: reopened with the purge)
            self._writer.close()
            self._writer = None
        self._purge_step = until_step + 1
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
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=90)
        plt.close(fig)
        return out

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            self._wandb.finish()
