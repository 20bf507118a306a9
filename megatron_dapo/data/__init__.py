"""Prompt datasets: DAPO-Math-17K / GSM8K loaders, the built-in arithmetic task, the prompt iterator."""

from megatron_dapo.data.arithmetic import (
    arithmetic_target,
    format_arithmetic_question,
    make_arithmetic_prompts,
)
from megatron_dapo.data.datasets import (
    GSM8K_PROMPT_TEMPLATE,
    LoadResult,
    load_prompts,
    normalize_integer_answer,
)
from megatron_dapo.data.iterator import PromptIterator
from megatron_dapo.data.templates import DAPO_MATH_TEMPLATE, TEMPLATE_NAMES, PromptFormat

__all__ = [
    "DAPO_MATH_TEMPLATE",
    "PromptFormat",
    "TEMPLATE_NAMES",
    "GSM8K_PROMPT_TEMPLATE",
    "LoadResult",
    "PromptIterator",
    "arithmetic_target",
    "format_arithmetic_question",
    "load_prompts",
    "make_arithmetic_prompts",
    "normalize_integer_answer",
]
