"""A run's curves, read back from its TensorBoard events: {tag: [[step, value], ...]}."""

from __future__ import annotations

from pathlib import Path

TAGS = ("val/acc_avg_at_k", "val/response_length_mean", "actor/entropy", "response_length/mean",
        "response_length/clip_ratio", "rollout/kept_group_frac", "rollout/gen_rounds", "rollout/samples_total",
        "train/acc_mean", "train/reward_mean", "actor/clipfrac_high", "actor/clipfrac_low", "actor/mean_token_prob",
        "timing/step_s", "tool/calls_per_sample", "tool/error_frac", "rollout/void_turn_frac", "rollout/turns_mean",
        "val/tool_calls_per_sample", "val/void_turn_frac")
"""What a study keeps of every run: the paper's panels (validation accuracy, actor entropy, mean
response length, kept-group fraction) and what explains them; with a tool, its call rate and void turns."""


def read_curves(logdir: Path, tags: tuple[str, ...] = TAGS) -> dict[str, list[list[float]]]:
    """Every tag of `tags` present in the event files under `logdir` (a later event of a step wins)."""
    from megatron_dapo.metrics import read_scalars

    points = read_scalars(logdir, tags)
    return {tag: [[step, value] for step, value in sorted(points[tag].items())] for tag in tags if tag in points}


def at(curve: list[list[float]], step: int) -> float | None:
    """The value of `curve` at `step`, or None."""
    return next((v for s, v in curve if s == step), None)


def first_reaching(curve: list[list[float]], target: float) -> int | None:
    """The first step whose value is >= target, or None."""
    return next((int(s) for s, v in curve if v >= target), None)
