"""Group-relative advantages (DAPO eq. 9 / GRPO): A_i = (R_i - mean(R)) / std(R) within a group, or
Dr. GRPO's A_i = R_i - mean(R) (Liu et al. 2025: dividing by std favours too easy and too hard groups)."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6, *, scale_by_std: bool = True) -> torch.Tensor:
    """Normalise rewards within each group of G responses to one prompt.

    Args:
        rewards: [num_groups, G] rewards R_i, one row per prompt.
        eps: added to the standard deviation for numerical safety.
        scale_by_std: False gives Dr. GRPO's R - mean (no division, `eps` unused).

    Returns:
        [num_groups, G] advantages (R - mean) / (std + eps) (or R - mean) in the dtype of `rewards`
        (integer rewards are promoted to float32). `std` is the *unbiased* (Bessel-corrected,
        divide by G-1) sample standard deviation, as `torch.std` in GRPO and verl. Groups whose
        rewards are all equal get exactly 0 (not (R - mean)/eps noise from rounding in the mean).

    Raises:
        ValueError: `rewards` is not 2-D or has fewer than two responses per group.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, G], got shape {tuple(rewards.shape)}")
    if rewards.shape[1] < 2:
        raise ValueError(f"need G >= 2 responses per group, got G={rewards.shape[1]}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    mean = rewards.mean(dim=1, keepdim=True)
    adv = rewards - mean
    if scale_by_std:
        adv = adv / (rewards.std(dim=1, keepdim=True, unbiased=True) + eps)
    # Equality, not std == 0: the mean of e.g. 0.1s need not round back to exactly 0.1.
    constant = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    return torch.where(constant, torch.zeros_like(adv), adv)
