"""DAPO algorithm pieces in plain torch: advantages, dynamic sampling, the token-level policy loss (and the
registry of its variants), rollout-correction weights.

This package is the reference the fused kernels must match; it imports neither Megatron nor SGLang.
"""

from megatron_dapo.algo.advantages import group_advantages
from megatron_dapo.algo.dynamic_sampling import (
    FILTER_METRICS,
    DynamicSampler,
    DynamicSamplingStats,
    FilterMetric,
    expected_informative_fraction,
    is_informative,
)
from megatron_dapo.algo.loss import AGG_MODES, LOG_RATIO_LIMIT, AggMode, PolicyLossMetrics, policy_loss
from megatron_dapo.algo.policy_losses import (
    LossInputs,
    PolicyLossSpec,
    TokenTerms,
    policy_loss_spec,
    register_policy_loss,
)
from megatron_dapo.algo.rollout_correction import (
    CORRECTIONS,
    CorrectionMetrics,
    correction_spec,
    correction_weights,
)

__all__ = [
    "AGG_MODES",
    "CORRECTIONS",
    "FILTER_METRICS",
    "LOG_RATIO_LIMIT",
    "AggMode",
    "CorrectionMetrics",
    "DynamicSampler",
    "DynamicSamplingStats",
    "FilterMetric",
    "LossInputs",
    "PolicyLossMetrics",
    "PolicyLossSpec",
    "TokenTerms",
    "correction_spec",
    "correction_weights",
    "expected_informative_fraction",
    "group_advantages",
    "is_informative",
    "policy_loss",
    "policy_loss_spec",
    "register_policy_loss",
]
