"""DAPO algorithm pieces in plain torch: advantages, dynamic sampling, the token-level policy loss.

This package is the reference the fused kernels must match; it imports neither Megatron nor SGLang.
"""

from megatron_dapo.algo.advantages import group_advantages
from megatron_dapo.algo.dynamic_sampling import (
    DynamicSampler,
    DynamicSamplingStats,
    expected_informative_fraction,
    is_informative,
)
from megatron_dapo.algo.loss import AGG_MODES, AggMode, PolicyLossMetrics, policy_loss

__all__ = [
    "AGG_MODES",
    "AggMode",
    "DynamicSampler",
    "DynamicSamplingStats",
    "PolicyLossMetrics",
    "expected_informative_fraction",
    "group_advantages",
    "is_informative",
    "policy_loss",
]
