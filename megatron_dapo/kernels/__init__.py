"""Fused kernels for the actor: vocab-parallel token logprob + entropy, and the DAPO loss on top.

Triton on CUDA, chunked torch elsewhere (see `resolve_impl`); neither materialises [N, V] log-softmax.
The `linear_` variants take hidden states and the lm-head weight and never hold full logits either.
"""

from megatron_dapo.kernels.linear_logprobs import linear_logprobs_and_entropy
from megatron_dapo.kernels.logprobs import IMPL_ENV, IMPLS, resolve_impl, token_logprobs_and_entropy
from megatron_dapo.kernels.policy_loss import (
    FusedLossMetrics,
    fused_linear_policy_loss,
    fused_policy_loss,
    loss_from_logprobs,
)

__all__ = [
    "IMPLS",
    "IMPL_ENV",
    "FusedLossMetrics",
    "fused_linear_policy_loss",
    "fused_policy_loss",
    "linear_logprobs_and_entropy",
    "loss_from_logprobs",
    "resolve_impl",
    "token_logprobs_and_entropy",
]
