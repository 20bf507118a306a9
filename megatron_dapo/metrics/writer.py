"""The run's scalars and samples to TensorBoard (the paper's §4.3 dashboard), optionally mirrored to W&B
(wandb_mirror.py), and an end-of-run PNG of the dynamics."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_dapo.config import WandbConfig
from megatron_dapo.metrics.events import read_scalars

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("accuracy", ("val/acc_avg_at_k", "train/acc_mean")),
    ("reward", ("train/reward_mean",)),
    ("response length (tokens)", ("response_length/mean",)),
    ("entropy", ("actor/entropy",)),
    ("mean token probability", ("actor/mean_token_prob",)),
    ("kept group fraction (dynamic sampling)", ("rollout/kept_group_frac",)),
    ("seconds per step", ("timing/step_s",)),
)
"""The summary's panels (the paper's §4.3 dynamics, accuracy and time): a title and the tags drawn in it."""
SUMMARY_CURVES = ("response_length/mean", "train/reward_mean", "actor/entropy", "actor/mean_token_prob",
                  "val/acc_avg_at_k")
PLOTTED = tuple(tag for _, tags in PANELS for tag in tags)


class MetricsWriter:
    """Writes scalars on the main rank only; keeps the history for the summary plot. With `wandb` enabled
    the same scalars and samples, and `run_config`, also go to a W&B run named after the folder."""

    def __init__(self, logdir: str | Path, enabled: bool = True, *, wandb: WandbConfig | None = None,
                 run_config: dict[str, Any] | None = None):
        self.logdir = Path(logdir)
        self.enabled = enabled
        self.history: dict[str, dict[int, float]] = defaultdict(dict)
        """tag -> step -> value (a replayed step overwrites)."""
        self._writer: SummaryWriter | None = None
        """The TensorBoard writer, opened at the first write: a run that dies while starting leaves no folder."""
        self._purge_step: int | None = None
        self._wandb = None
        self._sample_steps: set[int] = set()
        if enabled and wandb is not None and wandb.enabled:
            from megatron_dapo.metrics.wandb_mirror import WandbMirror

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
        """The run on one picture, next to the event files: its name and headline in the title, then a panel
        per curve it has (the paper's §4.3 dynamics, accuracy, seconds per step); absent ones are left out."""
        panels = self.summary_panels()
        if not self.enabled or not panels:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        cols = min(3, len(panels))
        rows = -(-len(panels) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 3.3 * rows + 0.6), squeeze=False)
        for ax, (title, curves) in zip(axes.flat, panels):
            for tag, points in curves:
                ax.plot(*zip(*points), marker="." if len(points) < 50 else None, label=tag)
            if len(curves) > 1:
                ax.legend(fontsize=8)
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
        fig.suptitle(self.headline(), fontsize=12)
        fig.tight_layout()
        out = Path(path) if path else self.logdir / "summary.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=90)
        plt.close(fig)
        return out

    def summary_panels(self) -> list[tuple[str, list[tuple[str, list[tuple[int, float]]]]]]:
        """(title, [(tag, sorted points)]) of each PANELS entry with at least one curve written."""
        panels = [(title, [(tag, sorted(self.history[tag].items())) for tag in tags if self.history.get(tag)])
                  for title, tags in PANELS]
        return [(title, curves) for title, curves in panels if curves]

    def headline(self) -> str:
        """`<run>: N steps, validation accuracy a -> b, T min of steps`: what the picture is about."""
        steps = max((step for points in self.history.values() for step in points), default=0)
        parts = [f"{self.logdir.name}: {steps} steps"]
        if val := sorted(self.history.get("val/acc_avg_at_k", {}).items()):
            parts.append(f"validation accuracy {val[0][1]:.3f} (step {val[0][0]}) -> {val[-1][1]:.3f} "
                         f"(step {val[-1][0]})")
        if seconds := sum(self.history.get("timing/step_s", {}).values()):
            parts.append(f"{seconds / 60:.1f} min of steps")
        return ", ".join(parts)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            self._wandb.finish()
