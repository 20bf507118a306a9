"""The steps base: the policy the DAPO study starts from (examples/configs/study_dapo_small.yaml).

A character-level Qwen2 like the tiny base, warm-started on the multi-step task
(`megatron_dapo.data.steps_task`, chains of 1-7 operations) with mixed answer styles (`steps_data`), so
that sampled at T=1 it is right in a minority of responses, of lengths from 4 tokens to past the
study's 80-token budget:

    ensure_steps_base()                                    # checkpoints/steps_base, built on first use
    python -m megatron_dapo.tiny --recipe steps --out checkpoints/steps_base

The build machinery, files and fingerprinting are the tiny base's (`megatron_dapo.tiny.base`).

Measured (2026-12-01, 2-core CPU, one thread): 1500 steps in 348 s (step-limited, so deterministic for
a seed; model.safetensors sha256 e1091b51...). On the 256 val prompts: greedy 0.340, sampled (T=1,
4 per prompt) 0.226, mean length 17.8 tokens, 2.6% truncated at 80. On 128 val prompts x 8 samples:
accuracy 0.19 (0.76 on 1-step chains, 0.31 on 2, 0.03-0.06 on 6-7); lengths 4 / 4 / 25 / 45 tokens at
the 25th / 50th / 75th / 90th percentile, max 80 (1.9% truncated, 1.6% in the soft-overlong zone);
groups of 8: 56% mixed, 43% all wrong, 0.8% all right. The model answers "direct" in 53% of samples
(weight 0.25; untested guess: length-grouped batches average the loss over few tokens in short
batches, so short targets weigh more), and a worked answer is right 58% of the time against 6% for
a direct one: the habit RL can unlearn is guessing, the way to more reward is longer responses.
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
