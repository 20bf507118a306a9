"""The step's training monitors (the paper's §4.3 dashboard); the rollout's are its own (collect/result.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_dapo import parallel
from megatron_dapo.types import Group, TrainBatch


@dataclass(frozen=True)
class TokenMeans:
    """Means over the step's generated tokens on every data-parallel rank."""

    mean_token_prob: float
    logprob_absdiff: float
    """|log pi_old - log pi_rollout|: the train-inference mismatch."""
    entropy: float | None
    """The pi_old pass's token entropy; None when no pass ran (pi_old taken from the rollout)."""


def token_means(batch: TrainBatch, entropy: torch.Tensor | None) -> TokenMeans:
    """A collective over data-parallel ranks (sums in float64, then one division)."""
    gen = batch.response_mask
    sums = [(batch.rollout_logprobs.exp() * gen).sum(), ((batch.old_logprobs - batch.rollout_logprobs).abs() * gen).sum(),
            gen.sum()] + ([] if entropy is None else [(entropy * gen).sum()])
    total = parallel.dp_sum(torch.tensor([float(x) for x in sums], dtype=torch.float64)).tolist()
    n = max(total[2], 1.0)
    return TokenMeans(total[0] / n, total[1] / n, None if entropy is None else total[3] / n)


def update_scalars(update: dict[str, float], means: TokenMeans) -> dict[str, float]:
    """The actor's update statistics and the token means; actor/entropy is the pi_old pass's (the policy
    the batch was sampled for) when one ran, else the update's first pass."""
    return {"actor/pg_loss": update["loss"], "actor/clipfrac_high": update["clipfrac_high"],
            "actor/clipfrac_low": update["clipfrac_low"], "actor/clipfrac_dual": update["clipfrac_dual"],
            "actor/grad_norm": update["grad_norm"], "actor/lr": update["lr"], "actor/approx_kl": update["approx_kl"],
            "actor/nonfinite": update["nonfinite"],
            "actor/entropy": update["entropy"] if means.entropy is None else means.entropy,
            "actor/mean_token_prob": means.mean_token_prob,
            "rollout/train_rollout_logprob_absdiff": means.logprob_absdiff,
            **{k: v for k, v in update.items() if k.startswith(("perf/", "moe/"))}}  # padding, prefix, routing


def step_timings(phase_seconds: dict[str, float], step_seconds: float, tokens: int,
                 weight_sync: dict[str, float] | None) -> dict[str, float]:
    """timing/<phase>_s per phase, the step's wall time, trained tokens per second, and the weight sync's
    byte counts (`SyncStats.scalars()`: perf/weight_sync_bytes, ..._sent_rank0, ..._cross_node)."""
    out = {f"timing/{k}_s": v for k, v in phase_seconds.items()}
    out.update(weight_sync or {})
    out["timing/step_s"] = step_seconds
    out["perf/tokens_per_s"] = tokens / step_seconds if step_seconds > 0 else 0.0
    return out


def why_no_signal(generated: list[Group], answer_fallback: str) -> str:
    """One line for a step whose groups were all uniform (nothing to learn from): what the responses scored and
    the most likely fix, so that a run that cannot learn says so at its first step."""
    samples = [s for g in generated for s in g.samples]
    n, correct = len(samples), sum(s.acc for s in samples)
    no_answer = sum(s.pred is None for s in samples)
    solved = sum(bool(g.samples) and all(s.acc for s in g.samples) for g in generated)
    head = (f"no informative group: {correct} of {n} responses correct, {no_answer} gave no answer the reward "
            f"could read; {solved} of {len(generated)} groups all correct")
    if n and 2 * no_answer >= n:
        fix = ("most responses give no answer in the rewarded form: try a prompt template or system prompt that "
               "asks for it (data.prompt_template, data.system_prompt)"
               + ("" if answer_fallback != "none" else " or reward.answer_fallback=boxed"))
    elif generated and solved == len(generated):
        fix = "every group solved: harder prompts or a larger algo.group_size"
    elif correct == 0:
        fix = "the answers are read but wrong: an easier task, or a larger algo.group_size for a rare success"
    else:
        fix = "a larger algo.group_size or algo.max_gen_rounds gives mixed groups more chances"
    return f"{head}: {fix}"
