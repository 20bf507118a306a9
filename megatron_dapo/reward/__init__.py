"""Rewards: DAPO-Math answer checking (eq. 7) or a user function, overlong shaping/filtering (eq. 13)."""

from megatron_dapo.reward.verifiers import RewardLoadError, Verifier, load_reward_fn
from megatron_dapo.reward.math_dapo import RewardResult, compute_score
from megatron_dapo.reward.overlong import overlong_filter_mask, soft_overlong_penalty
from megatron_dapo.reward.scorer import Scorer

__all__ = ["compute_score", "RewardResult", "soft_overlong_penalty", "overlong_filter_mask", "Scorer", "Verifier",
           "RewardLoadError", "load_reward_fn"]
