"""Prompt -> token ids, and response token ids -> text: the one rendering every stage shares.

The supervised warm-start (`tools/make_tiny_base.py`), the rollout and the trainer all render a
`Prompt` through `render_prompt_ids`, so the base model is trained on exactly the ids RL samples from:
  - a tokenizer with a chat template: the template applied to the messages with the generation
    prompt appended (the template adds whatever special tokens it wants);
  - a tokenizer without one (the tiny character-level base), or `model.chat_template=none`: the
    message contents joined by a blank line, encoded without special tokens (no BOS), e.g. "12+7=".

`use_chat_template` applies `model.chat_template` (auto | none | a Jinja file) to a tokenizer, and
`default_system_prompt` finds the system prompt a template adds when the messages carry none (Qwen2.5:
"You are Qwen, created by Alibaba Cloud. ..."), so start-up can say so.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from megatron_dapo.types import Prompt

__all__ = ["render_prompt_ids", "decode_response", "has_chat_template", "use_chat_template", "default_system_prompt"]
_SYSTEM_PROBE, _USER_PROBE = "SYSTEM-PROBE-5d1c", "USER-PROBE-9b2e"


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
    text = "\n\n".join(message["content"] for message in prompt.messages)
    return _as_int_list(tokenizer.encode(text, add_special_tokens=False))


def decode_response(tokenizer: Any, ids: Iterable[int]) -> str:
    """The text of generated token ids, without special tokens (EOS, padding)."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def use_chat_template(tokenizer: Any, choice: str) -> str:
    """Set `model.chat_template` on `tokenizer` in place: auto (its own, if any), none (plain text) or a
    Jinja file; returns what is used, in words, for the start-up summary."""
    if choice == "none":
        tokenizer.chat_template = None
        return "none (plain text, model.chat_template=none)"
    if choice == "auto":
        return "the tokenizer's own (model.chat_template=auto)" if has_chat_template(tokenizer) else \
            "none: the tokenizer has no chat template (plain text)"
    path = Path(choice)
    if not path.is_file():
        raise ValueError(f"model.chat_template={choice!r}: auto, none or a Jinja file; no such file")
    tokenizer.chat_template = path.read_text(encoding="utf-8")
    return f"{path} (model.chat_template)"


def default_system_prompt(tokenizer: Any) -> str | None:
    """The system text the chat template inserts for messages without a system message ("" for an
    empty system turn); None when it inserts none, has no template, or does not take system messages."""
    if not has_chat_template(tokenizer):
        return None
    user = [{"role": "user", "content": _USER_PROBE}]
    try:
        with_system = _render_text(tokenizer, [{"role": "system", "content": _SYSTEM_PROBE}, *user])
        without = _render_text(tokenizer, user)
    except Exception:  # a template may raise on a system role (it does not support one)
        return None
    if _SYSTEM_PROBE not in with_system or _USER_PROBE not in with_system:
        return None
    head, rest = with_system.split(_SYSTEM_PROBE, 1)
    between = rest[: rest.index(_USER_PROBE)]  # end of the system turn + start of the user turn
    if not head.strip() or not without.startswith(head):
        return None
    injected = without[len(head):]
    end = injected.find(between)
    return injected[:end] if end >= 0 else None


def _render_text(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
