"""The plain-torch fp32 oracle: materialised log_softmax + gather + entropy (also the bench's "naive").

It holds several [N, V] fp32 tensors for the backward; the kernels must match it, not copy it.
"""

from __future__ import annotations

import torch


def reference_logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (logprob of the target, entropy) of the distribution over this tensor's vocab.

    `targets` hold ids offset by `vocab_start` (use it on a full-vocab tensor: vocab_start=0).
    Assumes finite logits (a -inf logit makes 0 * -inf = nan in the entropy, as in most trainers).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    logprob = logp.gather(-1, (targets - vocab_start).unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return logprob, entropy
