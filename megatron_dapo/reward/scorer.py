"""R_i of a sample: the configured verifier (eq. 7 or a user function) plus eq. 13's overlong term."""

from __future__ import annotations

from megatron_dapo.config import RewardConfig
from megatron_dapo.reward.verifiers import Verifier
from megatron_dapo.reward.overlong import soft_overlong_penalty
from megatron_dapo.types import Sample


class Scorer:
    """Built once per run from `RewardConfig` (the user function is imported here, once)."""

    def __init__(self, cfg: RewardConfig, max_response_len: int) -> None:
        self.cfg, self.max_response_len = cfg, max_response_len
        self.verify = Verifier(cfg.name, timeout_s=cfg.timeout_s, answer_fallback=cfg.answer_fallback)

    def score(self, sample: Sample, ground_truth: str) -> None:
        """Fill sample.acc / pred / reward from sample.response_text, in place."""
        result = self.verify(sample.response_text, ground_truth, sample)
        sample.acc, sample.pred, sample.reward = bool(result.acc), result.pred, float(result.score)
        if self.cfg.soft_overlong_punishment:
            sample.reward += soft_overlong_penalty(sample.response_len, self.max_response_len,
                                                   self.cfg.overlong_cache_len, self.cfg.overlong_penalty_factor)

    def take_failures(self) -> int:
        return self.verify.take_failures()
