"""The tool base: a tiny policy that calls the Python tool some of the time (examples/configs/tiny_tool_cpu.yaml).

A character-level Qwen2 like the tiny base, warm-started on 3-digit x 3-digit multiplication ("482*937=", the
built-in arithmetic task with min_digits=max_digits=3, ops=*), a product too long for it to compute in its head,
answered in one of two styles redrawn at every use:

    tool     "```python\\nprint(482*937,end='')\\n```" + "```output:451634```" + "Answer: 451634"
    direct   "Answer: 451634"                   (what the model can only guess)

The tool target holds the observation exactly as rollout/tools/ appends it (with `FENCES`, which
examples/configs/tiny_tool_cpu.yaml sets), so the policy learns to write a block, stop at its fence, and copy the
result. The observation holds no space or newline: `AutoTokenizer` loads the tiny tokenizer as a Qwen2Tokenizer,
which drops both when it encodes (sampled tokens are never encoded, so only observations meet it).
RL can raise the tool-call rate:

    python -m megatron_dapo.tiny --recipe tool                   # checkpoints/tool_base
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_dapo.config.tools import ToolsConfig
from megatron_dapo.data.arithmetic import format_answer
from megatron_dapo.data.render import render_prompt_ids
from megatron_dapo.tiny.base import Recipe, ensure_base
from megatron_dapo.tiny.warmstart import Settings
from megatron_dapo.tiny.warmstart_data import Example
from megatron_dapo.types import Prompt

DEFAULT_OUT = "checkpoints/tool_base"
TASK = "min_digits=3&max_digits=3&ops=*"
TRAIN_SPEC = f"builtin:arithmetic?n=4000&seed=0&{TASK}"
"""= data.train_path of examples/configs/tiny_tool_cpu.yaml."""
VAL_SPEC = f"builtin:arithmetic?n=256&seed=12345&{TASK}"
MAX_NEW_TOKENS = 72
"""= rollout.max_response_len of the tool config: a tool response is about 60 tokens."""
STYLE_WEIGHTS: dict[str, float] = {"tool": 0.4, "direct": 0.6}
FENCES = ToolsConfig(name="python", output_open="```output:", output_close="```")
"""The tool base's rollout.tools fences (code_open / code_close are the defaults)."""
SETTINGS = Settings(max_position_embeddings=96, max_steps=800, seconds=600.0)
VERSION = 2


def style_response(prompt: Prompt, style: str) -> str:
    """The warm-start target of a multiplication `prompt` in `style` (see the module docstring)."""
    question = prompt.messages[-1]["content"].rstrip("=")
    answer = format_answer(int(prompt.ground_truth))
    if style == "direct":
        return answer
    if style == "tool":
        f = FENCES
        return (f"{f.code_open}print({question},end='')\n{f.code_close}{f.output_open}{prompt.ground_truth}"
                f"{f.output_close}{answer}")
    raise ValueError(f"unknown style {style!r}; expected one of {tuple(STYLE_WEIGHTS)}")


def make_examples(tokenizer: Any, prompts: Sequence[Prompt]) -> list[Example]:
    eos = tokenizer.eos_token_id
    return [Example(render_prompt_ids(tokenizer, p),
                    {s: tokenizer.encode(style_response(p, s), add_special_tokens=False) + [eos]
                     for s in STYLE_WEIGHTS})
            for p in prompts]


def draw_style(rng: random.Random) -> str:
    return rng.choices(list(STYLE_WEIGHTS), weights=list(STYLE_WEIGHTS.values()))[0]


def tool_recipe() -> Recipe:
    return Recipe(name="tool base", version=VERSION, train_spec=TRAIN_SPEC, val_spec=VAL_SPEC, settings=SETTINGS,
                  data={"style_weights": STYLE_WEIGHTS, "task": "tool",
                        "fences": [FENCES.output_open, FENCES.output_close]},
                  make_examples=make_examples, draw=draw_style, max_new_tokens=MAX_NEW_TOKENS, eval_samples=4)


def ensure_tool_base(out: str | Path = DEFAULT_OUT, seconds: float | None = None, *, seed: int = 0) -> Path:
    """`out`, after building the tool base there unless it holds one of this recipe's fingerprint."""
    return ensure_base(tool_recipe(), out, seconds, seed=seed)
