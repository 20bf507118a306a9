"""Token sampling shared by the embedded engine's decode loops (blocking and streaming).

The reported logprob is log softmax(logits / T) of the sampled token, before top-p truncation; T = 0 is greedy
with the plain log softmax. Top-p keeps transformers' TopPLogitsWarper's set (`nucleus`),
found among each row's top k tokens (k grown until the set ends within them) instead of by sorting the whole
vocabulary: a 49k-token sort per row was 40% of a SmolLM2 decode step on a CPU. A token is drawn by
inverse CDF from one uniform per row: from a torch.Generator (blocking `generate`: one random stream
per call) or given (streaming: `counter_uniforms`, a pure function of the row's key and position, so
a row's tokens do not depend on which other rows share its batch).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_dapo.rollout.base import NonFiniteLogitsError, SamplingParams

_M32 = 0xFFFFFFFF
_TOP_K = 64
"""Candidates of the first top-p search per row (grown 8x while their mass is below p)."""


def sample_next(logits: Tensor, sampling: SamplingParams, generator: torch.Generator | None,
                uniforms: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Next token per row and its logprob under softmax(logits / T) (pre top-p; T=0: argmax, T=1).

    `uniforms` [B, 1] in [0, 1): the draw of each row; without them, drawn from `generator`. Raises
    NonFiniteLogitsError when any logit is inf/NaN (sampling would return an id outside the vocabulary).
    """
    logits = logits.float()
    finite = torch.isfinite(logits).all(-1)
    if not bool(finite.all()):
        raise NonFiniteLogitsError(f"the engine's logits hold inf/NaN in {int((~finite).sum())} of "
                                   f"{logits.shape[0]} rows")
    if sampling.greedy:
        tokens = logits.argmax(-1)
        logprobs = logits.log_softmax(-1)
    else:
        scaled = logits / sampling.temperature
        logprobs = scaled.log_softmax(-1)
        probs = logprobs.exp()
        if sampling.top_p < 1.0:
            probs = scaled.masked_fill(~nucleus(probs, sampling.top_p), float("-inf")).softmax(-1)
        tokens = _draw(probs, generator, uniforms)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def nucleus(probs: Tensor, top_p: float) -> Tensor:
    """The top-p set of each row [B, V] (bool), transformers' TopPLogitsWarper's rule: a token goes when the mass
    of it and every less probable token is at most 1 - top_p (the most probable token always stays). Sums in
    float64: the set then differs from the warper's float32 scan only where a token's mass is within rounding of
    1 - top_p."""
    vocab, threshold = probs.shape[-1], 1.0 - top_p
    total = probs.sum(-1, dtype=torch.float64)[:, None]
    k = min(_TOP_K, vocab)
    while True:
        top, idx = probs.topk(k, dim=-1)  # descending
        top64 = top.double()
        at_and_below = total - (top64.cumsum(-1) - top64)
        if k == vocab or bool((at_and_below[:, -1] - top64[:, -1] <= threshold).all()):  # the (k+1)-th goes
            break
        k = min(8 * k, vocab)
    keep = at_and_below > threshold
    keep[:, 0] = True
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(1, idx, keep)


def _draw(probs: Tensor, generator: torch.Generator | None, u: Tensor | None = None) -> Tensor:
    """One token per row by inverse CDF: one uniform per row (torch.multinomial draws one per
    vocabulary entry, which made it the costliest op of a small-model decode step)."""
    cdf = probs.cumsum(-1)
    if u is None:
        u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=cdf.dtype)
    # x in (0, total]: the first index with cdf >= x is never a zero-probability token (cut by top-p).
    x = (1.0 - u.to(cdf.dtype)) * cdf[:, -1:]
    return torch.searchsorted(cdf, x).squeeze(1)


def _mix32(x: Tensor) -> Tensor:
    """lowbias32 (C. Wellons' hash prospector): a bijection of 32-bit values held in int64; both
    multipliers are below 2**31, so no product overflows int64."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def counter_uniforms(keys: Tensor, counters: Tensor) -> Tensor:
    """A uniform in [0, 1) per row [B, 1], a pure function of (keys[i], counters[i]) (int64 tensors:
    any 64-bit key, counter in [0, 2**32)); 24 random bits, as torch.rand's float32."""
    keys = keys.long()
    h = _mix32(_mix32(keys & _M32) ^ ((keys >> 32) & _M32))
    h = _mix32(h ^ (counters.long() & _M32))
    return ((h >> 8).float() * 2.0**-24)[:, None]
