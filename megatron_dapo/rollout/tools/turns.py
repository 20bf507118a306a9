"""One multi-turn conversation as token ids: the policy's sampled segments and the tool's observations, and
the decisions between them (run the code block just closed, continue, or finish).

Token in, token out: the response is the engine's sampled ids and the observation ids, concatenated; text is
decoded only to find a code block and to render nothing back. Generation stops on every token whose text holds
the last character of `code_close` (`close_stop_ids`): where the turn's text then holds a complete block the
block runs, else (a false stop, e.g. inside the opening fence) generation simply continues from the ids.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from megatron_dapo.config.tools import ToolsConfig
from megatron_dapo.sandbox.types import ToolResult
from megatron_dapo.types import FinishReason, Sample, ToolTrace


def encode(tokenizer: Any, text: str) -> list[int]:
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]


def decode(tokenizer: Any, ids: Iterable[int]) -> str:
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def close_stop_ids(tokenizer: Any, code_close: str) -> frozenset[int]:
    """Every token whose text holds the last character of `code_close`: a block can only be closed by one."""
    last = code_close[-1]
    vocab = len(tokenizer)
    return frozenset(i for i in range(vocab) if last in tokenizer.decode([i], skip_special_tokens=True))


def find_code(text: str, cfg: ToolsConfig) -> str | None:
    """The code of the first complete block (code_open ... code_close) in a turn's text, else None."""
    start = text.find(cfg.code_open)
    if start < 0:
        return None
    end = text.find(cfg.code_close, start + len(cfg.code_open))
    return None if end < 0 else text[start + len(cfg.code_open):end]


def result_text(result: ToolResult) -> str:
    """What the policy sees of a call: stdout, then stderr (a traceback, the sandbox's note)."""
    return result.stdout + result.stderr


@dataclass
class Conversation:
    """One sample's response so far; `next_step` decides after each sampled segment."""

    prompt_ids: list[int]
    budget: int
    """rollout.max_response_len: every response token counts, observations included."""
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    trace: ToolTrace = field(default_factory=ToolTrace)
    turn_start: int = 0
    finish: FinishReason | None = None
    code: str | None = None
    """A closed block waiting for its call."""

    @property
    def left(self) -> int:
        return self.budget - len(self.response)

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.response

    def add_segment(self, ids: list[int], logprobs: list[float], finish: FinishReason) -> FinishReason:
        """Append sampled tokens (cut to the budget: a longer continuation finishes as "length")."""
        if len(ids) > self.left:
            ids, logprobs, finish = ids[:self.left], logprobs[:self.left], "length"
        self.response += ids
        self.logprobs += logprobs
        return finish

    def next_step(self, ids: list[int], logprobs: list[float], finish: FinishReason, *, tokenizer: Any,
                  cfg: ToolsConfig, close_ids: frozenset[int], final_ids: frozenset[int]) -> None:
        """After a segment: hold a just-closed code block for the tool (`code`), continue after a false stop
        (neither), or finish: on a final stop token, the budget, or a stop with no room left ("length")."""
        finish = self.add_segment(ids, logprobs, finish)
        turn = decode(tokenizer, self.response[self.turn_start:])
        last = self.response[-1] if self.response else None
        close_stop = finish == "stop" and last in close_ids and last not in final_ids
        if close_stop and self.left > 0:
            if len(self.trace.statuses) < cfg.max_calls:
                self.code = find_code(turn, cfg)
            return
        self.finish = "length" if close_stop else finish
        self.trace.last_turn_code = find_code(turn, cfg) is not None

    def observe(self, result: ToolResult, *, tokenizer: Any, cfg: ToolsConfig) -> None:
        """Append the call's observation ids (its text cut to max_output_tokens tokens), out of the loss."""
        body = encode(tokenizer, result_text(result))[:cfg.max_output_tokens]
        obs = encode(tokenizer, cfg.output_open) + body + encode(tokenizer, cfg.output_close)
        obs = obs[:self.left]
        start = len(self.response)
        self.response += obs
        self.logprobs += [0.0] * len(obs)  # placeholders: observation tokens have no logprob
        self.trace.observations.append((start, len(self.response)))
        self.trace.statuses.append(result.status)
        self.trace.seconds.append(result.seconds)
        self.turn_start, self.code = len(self.response), None
        if self.left == 0:
            self.finish = "length"

    def sample(self) -> Sample:
        assert self.finish is not None
        return Sample(prompt_ids=list(self.prompt_ids), response_ids=list(self.response),
                      rollout_logprobs=list(self.logprobs), finish_reason=self.finish, tool=self.trace)


Tool = Callable[[str], Any]
"""code -> a Future of its ToolResult (SandboxPool.submit's form)."""
