"""Rule-based rewards: DAPO-Math answer checking (eq. 7) and overlong shaping/filtering (eq. 13)."""

from megatron_dapo.reward.math_dapo import RewardResult, compute_score
from megatron_dapo.reward.overlong import overlong_filter_mask, soft_overlong_penalty

__all__ = ["compute_score", "RewardResult", "soft_overlong_penalty", "overlong_filter_mask"]
