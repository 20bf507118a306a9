"""Every setting of the policy loss in one value, resolved and checked once at start-up and passed from the
config to the kernel: the variant, its clip range (the variant's defaults filled in), the aggregation and its
normalisers' L_max, dual-clip, and the entropy bonus's coefficient."""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from megatron_dapo.algo.policy_losses import PolicyLossSpec, clip_range, policy_loss_spec
from megatron_dapo.config.schema import AlgoConfig, LossAggMode

AGG_MODES: tuple[str, ...] = get_args(LossAggMode)


@dataclass(frozen=True)
class LossSettings:
    kind: str = "dapo"
    """The variant (algo/policy_losses.py): dapo, gspo, cispo, dr_grpo or `module.path:function`."""
    eps_low: float = 0.2
    eps_high: float = 0.28
    agg_mode: LossAggMode = "token-mean"
    clip_ratio_c: float | None = None
    """Dual-clip bound c > 1 (None = off, the paper's eq. 10)."""
    max_response_len: int | None = None
    """Dr. GRPO's L_max (its normaliser is global_num_seqs x L_max)."""
    entropy_coef: float = 0.0

    @classmethod
    def resolve(cls, kind: str = "dapo", eps_low: float | None = None, eps_high: float | None = None,
                agg_mode: str = "token-mean", clip_ratio_c: float | None = None,
                max_response_len: int | None = None, entropy_coef: float = 0.0) -> LossSettings:
        """The settings with the variant's default clip range where None; ValueError naming what is wrong."""
        spec = policy_loss_spec(kind)
        low, high = clip_range(spec, eps_low, eps_high)
        if clip_ratio_c is not None and not spec.dual_clip:
            raise ValueError(f"policy loss {spec.name!r} has no dual clip: clip_ratio_c must be None, "
                             f"got {clip_ratio_c}")
        if spec.normaliser == "max_len" and not (max_response_len is not None and max_response_len >= 1):
            raise ValueError(f"policy loss {spec.name!r} divides by global_num_seqs x max_response_len: "
                             f"max_response_len must be >= 1, got {max_response_len}")
        if agg_mode not in AGG_MODES:
            raise ValueError(f"unknown agg_mode {agg_mode!r}; valid: {', '.join(AGG_MODES)}")
        if not 0.0 <= low < 1.0:
            raise ValueError(f"eps_low must be in [0, 1), got {low}")
        if high < 0.0:
            raise ValueError(f"eps_high must be >= 0, got {high}")
        if clip_ratio_c is not None and not clip_ratio_c > 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 (or None to disable dual-clip), got {clip_ratio_c}")
        return cls(kind, low, high, agg_mode, clip_ratio_c, max_response_len, entropy_coef)  # type: ignore[arg-type]

    @classmethod
    def from_config(cls, algo: AlgoConfig, max_response_len: int | None) -> LossSettings:
        return cls.resolve(algo.policy_loss, algo.eps_low, algo.eps_high, algo.loss_agg_mode, algo.clip_ratio_c,
                           max_response_len, algo.entropy_coef)

    @property
    def spec(self) -> PolicyLossSpec:
        return policy_loss_spec(self.kind)
