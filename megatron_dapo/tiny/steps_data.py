"""The warm-start data of the steps base (`megatron_dapo.tiny.steps_base`): the multi-step task
(`megatron_dapo.data.steps_task`) answered in one of four styles, redrawn every time an example is used:

    worked   "7+5=12\\n12*3=36\\n36-9=27\\nAnswer: 27"    the working, line by line, then the answer
    direct   "Answer: 27"                              the answer without working
    ramble   "7+5*3-9=? 7+5*3-9=? Answer: 27"          1-4 echoes of the question, then the answer
    verify   the worked lines twice, then the answer   about twice as long as worked

Every target states the right number, but only "worked" (and "verify", which repeats it) shows how to
get it: sampled without the working, the model guesses the final value of a chain of operations and is
mostly wrong past one step, and "verify" runs past the RL budget on long chains (truncated, or in the
soft-overlong zone). So the base is right in a minority of samples, its lengths range from 4 tokens to
the budget, and what RL can learn is a style (work it out, do not repeat), how long to write, and
sharper step arithmetic.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from megatron_dapo.data.arithmetic import format_answer
from megatron_dapo.data.render import render_prompt_ids
from megatron_dapo.data.steps_task import chain_of, worked_solution
from megatron_dapo.tiny.warmstart_data import Example
from megatron_dapo.types import Prompt

STYLE_WEIGHTS: dict[str, float] = {"worked": 0.35, "direct": 0.25, "ramble": 0.2, "verify": 0.2}
"""Probability of each target style."""
RAMBLE_ECHOES = (1, 2, 3, 4)
"""How many times a "ramble" target echoes the question (drawn uniformly)."""


def style_response(prompt: Prompt, style: str, echoes: int = 1) -> str:
    """The warm-start target text of a steps `prompt` in `style` (see the module docstring)."""
    chain = chain_of(prompt)
    if style == "worked":
        return worked_solution(chain)
    if style == "direct":
        return format_answer(chain.answer)
    if style == "ramble":
        return f"{chain.question()}? " * echoes + format_answer(chain.answer)
    if style == "verify":
        return "\n".join([*chain.lines(), *chain.lines(), format_answer(chain.answer)])
    raise ValueError(f"unknown style {style!r}; expected one of {tuple(STYLE_WEIGHTS)}")


def variants() -> list[tuple[str, int]]:
    """Every (style, echoes) a target can take."""
    return [(s, 1) for s in STYLE_WEIGHTS if s != "ramble"] + [("ramble", k) for k in RAMBLE_ECHOES]


def make_examples(tokenizer: Any, prompts: Sequence[Prompt]) -> list[Example]:
    eos = tokenizer.eos_token_id
    return [Example(render_prompt_ids(tokenizer, p),
                    {(s, k): tokenizer.encode(style_response(p, s, k), add_special_tokens=False) + [eos]
                     for s, k in variants()})
            for p in prompts]


def draw_style(rng: random.Random) -> tuple[str, int]:
    style = rng.choices(list(STYLE_WEIGHTS), weights=list(STYLE_WEIGHTS.values()))[0]
    return style, rng.choice(RAMBLE_ECHOES) if style == "ramble" else 1
