"""Sampling parameters of every generation the trainer asks for, seeded by what the tokens are for.

A seed is a pure function of (train.seed, split, key): the training rollout's round r of step s
(`"train", s, r`), its group g when streaming (`"train", s, "group", g`), validation prompt i
(`"eval", i`). So a resumed run replays the same samples, and a prompt's samples do not depend on
what finishes first.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

from megatron_dapo.config import Config
from megatron_dapo.rollout.base import SamplingParams


def seed_of(*parts: Any) -> int:
    """A 32-bit seed that is a pure function of `parts` (stable across processes and resumes)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")


def eos_ids(tokenizer: Any) -> tuple[int, ...]:
    """The tokenizer's end of sequence, as a generation's stop tokens."""
    eos = tokenizer.eos_token_id
    return () if eos is None else (int(eos),)


def sampling_params(cfg: Config, eos_ids: tuple[int, ...], split: Literal["train", "eval"],
                    *key: Any) -> SamplingParams:
    """The rollout's (train) or the evaluation's (eval) temperature / top-p, the response budget, the
    tokenizer's end of sequence, and the seed of (train.seed, split, *key); the rollout's asks for its routes
    under actor.routing_replay=r3."""
    temperature, top_p = (cfg.eval.temperature, cfg.eval.top_p) if split == "eval" else \
        (cfg.rollout.temperature, cfg.rollout.top_p)
    return SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=cfg.rollout.max_response_len,
                          stop_token_ids=eos_ids, seed=seed_of(cfg.train.seed, split, *key),
                          return_routes=split == "train" and cfg.actor.routing_replay == "r3")
