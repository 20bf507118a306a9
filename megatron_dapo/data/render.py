"""Prompt -> token ids, and response token ids -> text: the one rendering every stage shares.

The supervised warm-start (`tools/make_tiny_base.py`), the rollout and the trainer all render a
`Prompt` through `render_prompt_ids`, so the base model is trained on exactly the ids RL samples from:
  - a tokenizer with a chat template: the template applied to the messages with the generation
    prompt appended (the template adds whatever special tokens it wants);
  - a tokenizer without one (the tiny character-level base): the message contents concatenated,
    encoded without special tokens (no BOS), e.g. "12+7=".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from megatron_dapo.types import Prompt

__all__ = ["render_prompt_ids", "decode_response", "has_chat_template"]


def has_chat_template(tokenizer: Any) -> bool:
    """True when `tokenizer` carries a (non-empty) chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def _as_int_list(ids: Any) -> list[int]:
    """A plain list of ints from what `apply_chat_template` returns across transformers versions.

    transformers 5 returns a `BatchEncoding` (a Mapping with "input_ids") for `tokenize=True`; 4.x a
    list; either may hold a tensor or a batch of one when asked to.
    """
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    if hasattr(ids, "tolist"):  # torch / numpy
        ids = ids.tolist()
    ids = list(ids)
    if ids and isinstance(ids[0], (list, tuple)):  # a batch of one
        if len(ids) != 1:
            raise ValueError(f"expected the ids of one conversation, got a batch of {len(ids)}")
        ids = list(ids[0])
    return [int(i) for i in ids]


def render_prompt_ids(tokenizer: Any, prompt: Prompt) -> list[int]:
    """The token ids the policy conditions on for `prompt` (see the module docstring)."""
    if has_chat_template(tokenizer):
        ids = tokenizer.apply_chat_template(
            list(prompt.messages), add_generation_prompt=True, tokenize=True
        )
        return _as_int_list(ids)
    text = "".join(message["content"] for message in prompt.messages)
    return _as_int_list(tokenizer.encode(text, add_special_tokens=False))


def decode_response(tokenizer: Any, ids: Iterable[int]) -> str:
    """The text of generated token ids, without special tokens (EOS, padding)."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)
