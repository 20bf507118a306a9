"""The policy-loss registry: each variant is a function from token inputs to token terms, registered by name.

`algo.policy_loss` names one: dapo (the default), gspo, cispo, dr_grpo, or `module.path:function`, a user's
function decorated with `@register_policy_loss(...)` (imported once, as a reward function is). A variant
returns per-token losses only; algo.loss.policy_loss masks them, multiplies the importance weights in and
divides by global counts, so every variant sums exactly over micro-batches and data-parallel ranks.

    from megatron_dapo.algo.policy_losses import LossInputs, TokenTerms, register_policy_loss

    @register_policy_loss("my_loss", eps_low=0.2, eps_high=0.28)
    def my_loss(x: LossInputs) -> TokenTerms: ...
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from megatron_dapo.config.fields import import_named
from megatron_dapo.config.schema import POLICY_LOSSES, REWARD_FUNCTION

LOG_RATIO_LIMIT = 20.0
"""log r = log pi_theta - log pi_old is clamped to [-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT] before exp.
r <= e^20 ~ 4.9e8 keeps r, r * A and the loss finite in fp32 whatever one wild token does. Inside the
range the loss is exact. Outside it r is held at the bound, so that token's gradient is zero, as for
a clipped token (torch.clamp passes the gradient on the closed range, the Triton kernel too)."""

Normaliser = Literal["agg_mode", "max_len"]


@dataclass(frozen=True)
class LossInputs:
    """[B, T] inputs of a variant. `advantages` are broadcast and zero where `valid` is False; other
    tensors may hold garbage (inf, nan) there, which a variant must keep out of its values (torch.where)."""

    logprobs: torch.Tensor
    """log pi_theta of the sampled tokens: the only input that carries a gradient."""
    old_logprobs: torch.Tensor
    """log pi_old (detached)."""
    advantages: torch.Tensor
    valid: torch.Tensor
    """bool: the tokens that enter the loss."""
    eps_low: float
    eps_high: float
    clip_ratio_c: float | None
    """Dual-clip bound (None = off); only passed to variants registered with dual_clip=True."""


@dataclass(frozen=True)
class TokenTerms:
    """A variant's [B, T] output. `loss` is minimised; the rest is detached, for the metrics."""

    loss: torch.Tensor
    """Token losses before the mask and importance weights; finite everywhere (0 where invalid)."""
    ratio: torch.Tensor
    """The ratio the variant weighs or clips (GSPO: the token's sequence ratio)."""
    log_ratio: torch.Tensor
    clip_high: torch.Tensor
    """bool: tokens whose upper clip (or weight cap) is active."""
    clip_low: torch.Tensor
    clip_dual: torch.Tensor


LossFn = Callable[[LossInputs], TokenTerms]


@dataclass(frozen=True)
class PolicyLossSpec:
    name: str
    fn: LossFn
    eps_low: float | None
    """Default for algo.eps_low (None: the variant has no lower bound, and eps_low must stay unset)."""
    eps_high: float
    """Default for algo.eps_high."""
    normaliser: Normaliser = "agg_mode"
    """agg_mode = loss_agg_mode's counts; max_len = global_num_seqs x max_response_len (Dr. GRPO)."""
    scale_advantages_by_std: bool = True
    """Group advantages divided by the group's std (False: Dr. GRPO's centred rewards)."""
    dual_clip: bool = False
    """Whether the function applies clip_ratio_c (else a clip_ratio_c is refused)."""
    ratio: Literal["token", "sequence"] | None = None
    """The loss is the clipped surrogate -min(r A, clip(r) A) (dual clip included) of a token ratio or of its
    sequence's ratio: the fused Triton clip kernel computes it. None: only the torch function does."""


REGISTRY: dict[str, PolicyLossSpec] = {}


class PolicyLossLoadError(ValueError):
    """algo.policy_loss names no registered loss or no importable decorated function."""


def register_policy_loss(name: str, *, eps_low: float | None = 0.2, eps_high: float = 0.28,
                         normaliser: Normaliser = "agg_mode", scale_advantages_by_std: bool = True,
                         dual_clip: bool = False, ratio: Literal["token", "sequence"] | None = None,
                         ) -> Callable[[LossFn], LossFn]:
    """Register `fn` under `name` (see PolicyLossSpec for the options); `fn.policy_loss_spec` is its spec.

    Declare `ratio` only for a function that IS clipped_surrogate of that ratio: on CUDA the fused clip
    kernel then computes it instead of `fn`."""

    def wrap(fn: LossFn) -> LossFn:
        spec = PolicyLossSpec(name, fn, eps_low, eps_high, normaliser, scale_advantages_by_std, dual_clip,
                              ratio)
        old = REGISTRY.get(name)
        if old is not None and (old.fn.__module__, old.fn.__qualname__) != (fn.__module__, fn.__qualname__):
            raise PolicyLossLoadError(f"policy loss {name!r} is registered already (by {old.fn.__module__})")
        REGISTRY[name] = spec
        fn.policy_loss_spec = spec  # type: ignore[attr-defined]
        return fn

    return wrap


@functools.lru_cache(maxsize=None)
def policy_loss_spec(kind: str) -> PolicyLossSpec:
    """The spec `kind` names: a registered name, or `module.path:function` (imported once)."""
    if kind in REGISTRY:
        return REGISTRY[kind]
    if not REWARD_FUNCTION.fullmatch(kind):
        raise PolicyLossLoadError(f"unknown policy loss {kind!r}; valid: {', '.join(REGISTRY)} "
                                  "or module.path:function")
    module_name, fn_name = kind.split(":")
    spec = getattr(import_named(kind, "algo.policy_loss", PolicyLossLoadError), "policy_loss_spec", None)
    if not isinstance(spec, PolicyLossSpec):
        raise PolicyLossLoadError(f"algo.policy_loss={kind!r}: {module_name}.{fn_name} is not a function "
                                  "decorated with @megatron_dapo.algo.policy_losses.register_policy_loss")
    return spec


def clip_range(spec: PolicyLossSpec, eps_low: float | None, eps_high: float | None) -> tuple[float, float]:
    """(eps_low, eps_high) with None replaced by the variant's defaults (an unused eps_low becomes 0)."""
    low = spec.eps_low if eps_low is None else eps_low
    return (0.0 if low is None else low), (spec.eps_high if eps_high is None else eps_high)


# --- the built-in variants -----------------------------------------------------------------------------

def _masked(valid: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, t, torch.zeros_like(t))


def clipped_surrogate(log_ratio: torch.Tensor, x: LossInputs) -> TokenTerms:
    """-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) with r = exp(log_ratio); with dual-clip (Ye et al.
    2020) c A replaces it where A < 0 and r > c (for A < 0 the clipped objective is A max(r, 1 - eps_low),
    below c A exactly when r > c, as c > 1), with zero gradient there."""
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - x.eps_low, 1.0 + x.eps_high)
    objective = torch.minimum(ratio * x.advantages, clipped * x.advantages)
    r, adv = ratio.detach(), x.advantages
    if x.clip_ratio_c is None:
        dual = torch.zeros_like(r, dtype=torch.bool)
    else:
        dual = (adv < 0) & (r > x.clip_ratio_c)
        objective = torch.where(dual, x.clip_ratio_c * adv, objective)
    high, low = (adv > 0) & (r > 1.0 + x.eps_high), (adv < 0) & (r < 1.0 - x.eps_low)
    return TokenTerms(loss=-objective, ratio=r, log_ratio=log_ratio.detach(), clip_high=high, clip_low=low,
                      clip_dual=dual)


def token_log_ratio(x: LossInputs) -> torch.Tensor:
    """log r_t = log pi_theta - log pi_old per token, 0 where invalid, clamped to +-LOG_RATIO_LIMIT."""
    return _masked(x.valid, x.logprobs - x.old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


@register_policy_loss("dapo", eps_low=0.2, eps_high=0.28, dual_clip=True, ratio="token")
def dapo(x: LossInputs) -> TokenTerms:
    """DAPO (Yu et al. 2025, eq. 10): the token-level clipped surrogate with decoupled clip (Clip-Higher),

        J = (1 / sum_i |o_i|) sum_i sum_t min(r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i),
        r_it = pi_theta(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t);  eps_low = 0.2, eps_high = 0.28.
    """
    return clipped_surrogate(token_log_ratio(x), x)


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, valid: torch.Tensor
                       ) -> torch.Tensor:
    """[B, 1]: (1 / |y_i|) sum_t (log pi_theta - log pi_old) over the row's valid tokens (0 if none)."""
    count = valid.sum(dim=-1, keepdim=True).clamp(min=1).to(logprobs.dtype)
    return _masked(valid, logprobs - old_logprobs).sum(dim=-1, keepdim=True) / count


@register_policy_loss("gspo", eps_low=3e-4, eps_high=4e-4, dual_clip=True, ratio="sequence")
def gspo(x: LossInputs) -> TokenTerms:
    """GSPO (Zheng et al. 2025), in its GSPO-token form (eq. 13-14):

        s_i = (pi_theta(y_i | x) / pi_old(y_i | x))^(1/|y_i|) = exp((1/|y_i|) sum_t log(pi_theta/pi_old)),
        s_it = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)]   (value s_i; d s_it / d log pi_theta = s_i),
        J = (1/G) sum_i (1/|y_i|) sum_t min(s_it A_it, clip(s_it, 1 - eps_low, 1 + eps_high) A_it).

    The whole sequence is clipped or not; with A_it = A_i the gradient equals GSPO's sequence-level one
    (eq. 7) under loss_agg_mode=seq-mean-token-mean (the J above); other modes weigh the same token terms
    differently. The paper's clip range: eps_low = 3e-4, eps_high = 4e-4. |log s_i| beyond LOG_RATIO_LIMIT:
    s_i is held at the bound with zero gradient, as a token ratio is in DAPO. Dual-clip applies to s_i.
    """
    seq = sequence_log_ratio(x.logprobs.detach(), x.old_logprobs, x.valid)
    live = x.valid & (seq.abs() <= LOG_RATIO_LIMIT)
    passthrough = _masked(live, x.logprobs - x.logprobs.detach())  # value 0, gradient 1
    log_ratio = _masked(x.valid, seq.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT) + passthrough)
    return clipped_surrogate(log_ratio, x)


@register_policy_loss("cispo", eps_low=None, eps_high=5.0)
def cispo(x: LossInputs) -> TokenTerms:
    """CISPO (MiniMax-M1, Chen et al. 2025, eq. 4-5): a clipped, detached importance weight times the
    advantage times log pi_theta, so every token keeps a gradient (none is clipped away):

        J = (1 / sum_i |o_i|) sum_i sum_t sg[min(r_it, eps_high)] A_it log pi_theta(o_it | q, o_i<t).

    eps_high is the weight's cap itself (not 1 + eps): ScaleRL (Khatri et al. 2025) recommends 5, the default
    here, as TRL does. There is no lower bound (MiniMax sets eps_low large), so algo.eps_low is unused, and no
    dual clip. clip_high counts the tokens whose weight is capped. Token-mean is the paper's aggregation.
    """
    log_ratio = _masked(x.valid, x.logprobs.detach() - x.old_logprobs)
    log_ratio = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(max=x.eps_high)
    none = torch.zeros_like(x.valid)
    return TokenTerms(loss=-(weight * x.advantages * _masked(x.valid, x.logprobs)), ratio=ratio,
                      log_ratio=log_ratio, clip_high=x.valid & (ratio > x.eps_high), clip_low=none,
                      clip_dual=none)


@register_policy_loss("dr_grpo", eps_low=0.2, eps_high=0.2, normaliser="max_len",
                      scale_advantages_by_std=False, dual_clip=True, ratio="token")
def dr_grpo(x: LossInputs) -> TokenTerms:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", eq. 3): PPO's clipped token terms
    with two biases of GRPO removed, the std division of the advantage and the length normalisation:

        A_i = R_i - mean(R)   (not divided by std(R): group_advantages(scale_by_std=False)),
        J = (1 / (G L_max)) sum_i sum_t min(r_it A_i, clip(r_it, 1 - eps, 1 + eps) A_i),  eps = 0.2,

    i.e. the token terms summed and divided by the constant global_num_seqs x max_response_len (L_max) instead
    of token counts; loss_agg_mode does not apply.
    """
    return clipped_surrogate(token_log_ratio(x), x)


assert tuple(REGISTRY) == POLICY_LOSSES, "config.schema.POLICY_LOSSES must list the built-in losses"
