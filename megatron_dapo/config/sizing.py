"""Micro-batch token budgets from the vocabulary, for `actor.micro_batch_tokens=0` (the default).

At a real vocabulary the logits dominate a small model's activation memory: one micro-batch holds
tokens x vocab / TP fp32 logits, several times over (logits, their gradient, softmax pieces). So the
budget is the largest power of two whose fp32 logits shard fits LOGITS_BUDGET (CPU: RAM shared with
the optimizer and the rollout engine; GPU: the actor's share of HBM), clamped to [256, 16384] tokens
(the pi_old pass: twice the budget, up to 32768, as it keeps no gradient).
"""

from __future__ import annotations

import math
from dataclasses import replace

from megatron_dapo.config.schema import ActorConfig

LOGITS_BUDGET = {"cpu": 256 * 2**20, "gpu": 2 * 2**30}
MIN_TOKENS, MAX_TRAIN_TOKENS, MAX_LOGPROB_TOKENS = 256, 16384, 32768


def padded_vocab_per_rank(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary (a multiple of divisible_by x TP) divided over TP ranks."""
    return math.ceil(vocab_size / (divisible_by * tp)) * divisible_by


def auto_tokens(vocab_size: int, tp: int, *, on_gpu: bool, logprob: bool = False) -> int:
    budget = LOGITS_BUDGET["gpu" if on_gpu else "cpu"] * (2 if logprob else 1)
    fits = budget // (padded_vocab_per_rank(vocab_size, tp) * 4)
    top = MAX_LOGPROB_TOKENS if logprob else MAX_TRAIN_TOKENS
    return min(max(2 ** max(fits, 1).bit_length() // 2, MIN_TOKENS), top)


def resolve_micro_batches(actor: ActorConfig, vocab_size: int, tp: int, *, on_gpu: bool) -> ActorConfig:
    """`actor` with 0 (auto) budgets replaced by `auto_tokens`; explicit values are kept."""
    train = actor.micro_batch_tokens or auto_tokens(vocab_size, tp, on_gpu=on_gpu)
    logprob = actor.logprob_micro_batch_tokens or auto_tokens(vocab_size, tp, on_gpu=on_gpu, logprob=True)
    return replace(actor, micro_batch_tokens=train, logprob_micro_batch_tokens=logprob)
