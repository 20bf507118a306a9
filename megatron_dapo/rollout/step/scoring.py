"""What both collectors (rounds, streaming) and the evaluation share: a prompt rendered to token ids,
and a finished group decoded and scored."""

from __future__ import annotations

from typing import Any

from megatron_dapo.data.render import decode_response, render_prompt_ids
from megatron_dapo.reward.scorer import Scorer
from megatron_dapo.types import Group, Prompt

RenderedPrompt = tuple[Prompt, list[int]]
"""A prompt and its token ids (the chat template applied)."""


def rendered(tokenizer: Any, prompt: Prompt) -> RenderedPrompt:
    return prompt, render_prompt_ids(tokenizer, prompt)


def score_group(group: Group, tokenizer: Any, scorer: Scorer) -> None:
    """Decode every response of the group and score it in place (reward, acc, pred)."""
    for s in group.samples:
        s.response_text = decode_response(tokenizer, s.response_ids)
        scorer.score(s, group.prompt.ground_truth)
