"""What both collectors (rounds, streaming) and the evaluation share: a prompt rendered to token ids,
and a finished group decoded and scored; the collectors' prompt source and scorer."""

from __future__ import annotations

from typing import Any

from megatron_dapo.data import PromptIterator
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


class PromptSource:
    """The training prompts the collectors draw, one at a time, rendered (the driver's data iterator)."""

    def __init__(self, prompts: PromptIterator, tokenizer: Any) -> None:
        self.prompts, self.tokenizer = prompts, tokenizer

    def __call__(self) -> RenderedPrompt:
        (prompt,) = self.prompts.next_batch()
        return rendered(self.tokenizer, prompt)


class GroupScorer:
    """A finished group decoded and scored in place by the run's scorer (reward.name + the overlong term)."""

    def __init__(self, tokenizer: Any, scorer: Scorer) -> None:
        self.tokenizer, self.scorer = tokenizer, scorer

    def __call__(self, group: Group) -> None:
        score_group(group, self.tokenizer, self.scorer)

    def take_failures(self) -> int:
        """Verifier failures (scored -1) since the last call."""
        return self.scorer.take_failures()
