"""Groups of scored samples -> the padded token tensors the actor trains on (plain torch)."""

from __future__ import annotations

import torch

from megatron_dapo.algo.advantages import group_advantages
from megatron_dapo.reward.overlong import overlong_filter_mask
from megatron_dapo.types import Group, TrainBatch


def build_train_batch(groups: list[Group], *, overlong_filtering: bool, pad_id: int = 0,
                      scale_by_std: bool = True) -> TrainBatch:
    """One row per sample, group by group. loss_mask covers the response tokens; with overlong
    filtering, truncated responses (finish reason "length") are masked out entirely. `scale_by_std`:
    group_advantages' switch (False for Dr. GRPO)."""
    if not groups:
        raise ValueError("build_train_batch needs at least one group")
    samples = [s for g in groups for s in g.samples]
    rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
    advantages = group_advantages(rewards, scale_by_std=scale_by_std).reshape(-1)
    lengths = torch.tensor([len(s.prompt_ids) + s.response_len for s in samples])
    width = int(lengths.max())
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(samples), width)
    rollout_lp = torch.zeros(len(samples), width)
    generated = torch.zeros(len(samples), width)
    keep = overlong_filter_mask([s.truncated for s in samples]) if overlong_filtering else [1.0] * len(samples)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), s.response_len
        ids[i, :p + r] = torch.tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.long)
        rollout_lp[i, p:p + r] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        generated[i, p:p + r] = 1.0
        mask[i, p:p + r] = keep[i]
    prompt_index = torch.arange(len(groups)).repeat_interleave(torch.tensor([len(g.samples) for g in groups]))
    return TrainBatch(input_ids=ids, loss_mask=mask, advantages=advantages, lengths=lengths,
                      rollout_logprobs=rollout_lp, prompt_index=prompt_index, response_mask=generated)

