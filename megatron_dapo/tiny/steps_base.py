"""The steps base: the policy the DAPO study starts from (examples/configs/study_dapo_small.yaml).

A character-level Qwen2 like the tiny base, warm-started on the multi-step task
(`megatron_dapo.data.steps`, chains of 1-7 operations) with mixed answer styles (`steps_data`), so
that sampled at T=1 it is right in a minority of responses, of lengths from 4 tokens to past the
study's 80-token budget:

    ensure_steps_base()                                    # checkpoints/steps_base, built on first use
    python -m megatron_dapo.tiny --recipe steps --out checkpoints/steps_base

The build machinery, files and fingerprinting are the tiny base's (`megatron_dapo.tiny.base`).
"""

from __future__ import annotations

from pathlib import Path

from megatron_dapo.tiny.base import Recipe, ensure_base
from megatron_dapo.tiny.steps_data import RAMBLE_ECHOES, STYLE_WEIGHTS, draw_style, make_examples
from megatron_dapo.tiny.warmstart import Settings

DEFAULT_OUT = "checkpoints/steps_base"
TASK = "min_steps=1&max_steps=7"
TRAIN_SPEC = f"builtin:steps?n=8000&seed=0&split=train&{TASK}"
"""= data.train_path of examples/configs/study_dapo_small.yaml."""
VAL_SPEC = f"builtin:steps?n=256&seed=12345&split=val&{TASK}"
"""= data.val_path of the study config."""
MAX_NEW_TOKENS = 80
"""= rollout.max_response_len of the study config."""
SETTINGS = Settings(max_position_embeddings=128, max_steps=1500, seconds=900.0, warmup_steps=100)
"""The 0.6M-parameter model of the tiny base, with room for 80-token responses."""
VERSION = 1


def steps_recipe() -> Recipe:
    return Recipe(name="steps base", version=VERSION, train_spec=TRAIN_SPEC, val_spec=VAL_SPEC, settings=SETTINGS,
                  data={"style_weights": STYLE_WEIGHTS, "ramble_echoes": list(RAMBLE_ECHOES), "task": "steps"},
                  make_examples=make_examples, draw=draw_style, max_new_tokens=MAX_NEW_TOKENS, eval_samples=4,
                  length_pool=16)


def ensure_steps_base(out: str | Path = DEFAULT_OUT, seconds: float | None = None, *, seed: int = 0) -> Path:
    """`out`, after building the steps base there unless it holds one of this recipe's fingerprint."""
    return ensure_base(steps_recipe(), out, seconds, seed=seed)
