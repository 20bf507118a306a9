"""Scored groups -> the padded token tensors the actor trains on (plain torch), one box of Algorithm 1 each:
the groups' rewards, the overlong filter's per-sample loss weights, and the rows themselves."""

from __future__ import annotations

import torch

from megatron_dapo.reward.overlong import overlong_filter_mask
from megatron_dapo.types import Group, Sample, TrainBatch


def group_rewards(groups: list[Group]) -> torch.Tensor:
    """[num_groups, G] float32: the reward of every sample, one row per prompt (group_advantages' input)."""
    return torch.tensor([g.rewards for g in groups], dtype=torch.float32)


def overlong_weights(groups: list[Group]) -> list[float]:
    """DAPO's overlong filtering: 0.0 for a truncated sample (finish reason "length"), 1.0 otherwise."""
    return overlong_filter_mask([s.truncated for g in groups for s in g.samples])


def void_turn_weights(groups: list[Group]) -> list[float]:
    """SimpleTIR's void-turn filter: 0.0 for a multi-turn sample whose last turn holds neither a complete code
    block nor an answer the reward could read (pred None), 1.0 otherwise (single-turn samples included)."""
    return [0.0 if s.void_turn else 1.0 for g in groups for s in g.samples]


def build_train_batch(groups: list[Group], advantages: torch.Tensor, *, loss_weights: list[float] | None = None,
                      pad_id: int = 0) -> TrainBatch:
    """One row per sample, group by group. `advantages`: [num_groups, G] (or flat), one per sample; loss_mask
    covers the response tokens, times the sample's `loss_weights` entry (overlong filtering; default 1). A
    multi-turn sample's tool observations are in the row but out of loss_mask and response_mask (no
    statistics); their rollout logprobs are the engine's placeholders (0)."""
    if not groups:
        raise ValueError("build_train_batch needs at least one group")
    samples = [s for g in groups for s in g.samples]
    advantages = advantages.reshape(-1)
    if advantages.numel() != len(samples):
        raise ValueError(f"{advantages.numel()} advantages for {len(samples)} samples")
    keep = [1.0] * len(samples) if loss_weights is None else loss_weights
    lengths = torch.tensor([len(s.prompt_ids) + s.response_len for s in samples])
    width = int(lengths.max())
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(samples), width)
    rollout_lp = torch.zeros(len(samples), width)
    generated = torch.zeros(len(samples), width)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), s.response_len
        ids[i, :p + r] = torch.tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.long)
        rollout_lp[i, p:p + r] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        generated[i, p:p + r] = 1.0
        mask[i, p:p + r] = keep[i]
        for start, end in () if s.tool is None else s.tool.observations:  # context, never trained
            generated[i, p + start:p + end] = 0.0
            mask[i, p + start:p + end] = 0.0
    prompt_index = torch.arange(len(groups)).repeat_interleave(torch.tensor([len(g.samples) for g in groups]))
    return TrainBatch(input_ids=ids, loss_mask=mask, advantages=advantages, lengths=lengths,
                      rollout_logprobs=rollout_lp, prompt_index=prompt_index, response_mask=generated,
                      routes=rollout_routes(samples, width))


def rollout_routes(samples: list[Sample], width: int) -> torch.Tensor | None:
    """[B, width, layers, k]: each sample's rollout routes (Sample.routes, r3) at the positions the engine read,
    0 at its last token and the padding (replayed there, never counted: actor/routing.py); None when no sample
    carries routes."""
    have = [s.routes is not None for s in samples]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(f"{have.count(False)} of {len(samples)} samples came back without their routes")
    first = samples[0].routes
    out = torch.zeros(len(samples), width, *first.shape[1:], dtype=first.dtype)
    for i, s in enumerate(samples):
        if s.routes.shape[0] != len(s.prompt_ids) + s.response_len - 1:
            raise ValueError(f"sample {i}: routes of {s.routes.shape[0]} positions for "
                             f"{len(s.prompt_ids) + s.response_len} tokens")
        out[i, : s.routes.shape[0]] = s.routes
    return out
