"""Typed contracts between the stages of one DAPO step: data -> rollout -> reward -> algo -> actor."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

FinishReason = Literal["stop", "length", "abort"]
""""abort": a response cut short by a stream's abort (partial rollout carries it on; never trained)."""


@dataclass(frozen=True)
class Prompt:
    """One problem from a dataset, before tokenisation."""

    uid: str
    """Stable id: `<data_source>/<row index>`; identical across resumes."""
    messages: tuple[dict[str, str], ...]
    """Chat messages ({"role", "content"}), rendered by the tokenizer's chat template (or plain join)."""
    ground_truth: str
    """The reference answer (an integer string for DAPO-Math-17K and GSM8K)."""
    data_source: str = "unknown"

    @classmethod
    def from_dict(cls, d: dict) -> Prompt:
        """From `dataclasses.asdict` after a JSON round trip (lists back to tuples)."""
        return cls(**{**d, "messages": tuple(d["messages"])})


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds an expert index (Sample.routes, TrainBatch.routes)."""
    return torch.uint8 if num_experts <= 256 else torch.int16


@dataclass
class ToolTrace:
    """A multi-turn sample's conversation (rollout/tools/): where the tool's observations sit in its response
    and how its calls went. Observation tokens are context, never trained (loss mask 0, no statistics)."""

    observations: list[tuple[int, int]] = field(default_factory=list)
    """(start, end) response-token spans of the observations, in order."""
    statuses: list[str] = field(default_factory=list)
    """Each call's sandbox status (ok | error | timeout | killed)."""
    seconds: list[float] = field(default_factory=list)
    """Each call's seconds in the sandbox."""
    last_turn_code: bool = False
    """The last turn holds a complete code block (one left unrun after max_calls): not a void turn."""

    @property
    def turns(self) -> int:
        return len(self.observations) + 1

    def observation_mask(self, response_len: int) -> list[bool]:
        """True on every observation token of a response of this length."""
        mask = [False] * response_len
        for start, end in self.observations:
            mask[start:end] = [True] * (end - start)
        return mask


@dataclass
class Sample:
    """One generated response o_i to a prompt q."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    """log pi_rollout(o_t | q, o_<t) as reported by the rollout engine, one per response token."""
    finish_reason: FinishReason
    """"length" means the response hit max_response_len: it is truncated."""
    response_text: str = ""
    reward: float = 0.0
    """Final scalar reward R_i (rule reward + soft overlong term)."""
    acc: bool = False
    pred: str | None = None
    versions: list[tuple[int, int]] = field(default_factory=list)
    """(first response token, policy version) spans: the weights after which update made which tokens
    (version s = after step s's update; set by the step's collector). A sample continued by a later step
    (partial rollout) has one span per step that extended it."""
    tool: ToolTrace | None = None
    """A multi-turn sample's turns (rollout.tools); None = a single-turn sample."""
    routes: torch.Tensor | None = None
    """[prompt + response tokens - 1, MoE layers, top_k] small ints: the experts the rollout engine's routers
    picked for every token it read (prompt and response, the last response token excepted: no forward reads
    it), when asked (SamplingParams.return_routes). Rollout routing replay (r3) trains on them."""

    @classmethod
    def from_dict(cls, d: dict) -> Sample:
        """From `dataclasses.asdict` after a JSON round trip (spans back to tuples; none before they existed)."""
        tool = d.get("tool")
        if tool is not None:
            tool = ToolTrace(**{**tool, "observations": [tuple(o) for o in tool["observations"]]})
        return cls(**{**d, "versions": [tuple(v) for v in d.get("versions", ())], "tool": tool})

    @property
    def void_turn(self) -> bool:
        """SimpleTIR's void turn (multi-turn samples, after scoring): the last turn holds neither a complete code
        block nor an answer the reward could read."""
        return self.tool is not None and not self.tool.last_turn_code and self.pred is None

    def observation_mask(self) -> list[bool]:
        """True on the response tokens that are tool observations (none for a single-turn sample)."""
        return [False] * self.response_len if self.tool is None else self.tool.observation_mask(self.response_len)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def response_len(self) -> int:
        return len(self.response_ids)


@dataclass
class Group:
    """The G responses sampled for one prompt; the unit of dynamic sampling and of advantages."""

    prompt: Prompt
    samples: list[Sample] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict) -> Group:
        return cls(Prompt.from_dict(d["prompt"]), [Sample.from_dict(s) for s in d["samples"]])

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    @property
    def num_correct(self) -> int:
        return sum(s.acc for s in self.samples)


@dataclass
class TrainBatch:
    """Right-padded token tensors the actor trains on; row i is one sample.

    All tensors are [B, S] except `advantages` which is [B] (broadcast to every token of o_i).
    Position t of `loss_mask`/`old_logprobs` refers to predicting token t of `input_ids` (t >= 1).
    """

    input_ids: torch.Tensor
    """[B, S] int64: prompt + response tokens, padded on the right."""
    loss_mask: torch.Tensor
    """[B, S] float: 1 on response tokens that enter the loss (0 on prompt, padding, filtered)."""
    advantages: torch.Tensor
    """[B] float: group-normalised advantage of each sample."""
    lengths: torch.Tensor
    """[B] int64: prompt + response tokens of each row (the rest is padding)."""
    old_logprobs: torch.Tensor | None = None
    """[B, S] float: log pi_old of each token (filled by the actor before the updates)."""
    rollout_logprobs: torch.Tensor | None = None
    """[B, S] float: log pi_rollout reported by the engine (for the train/rollout mismatch metric)."""
    prompt_index: torch.Tensor | None = None
    """[B] int64: which group (prompt) each row came from."""
    response_mask: torch.Tensor | None = None
    """[B, S] float: 1 on every generated token, truncated responses included (for monitors)."""
    is_weights: torch.Tensor | None = None
    """[B, S] float: rollout-correction importance weights multiplying the loss terms (None = all 1)."""
    routes: torch.Tensor | None = None
    """[B, S, layers, top_k] small ints: the experts each token went to, which the updates replay
    (actor.routing_replay; actor/routing.py): recorded by the pi_old pass in this rank's MoE layers (r2), or the
    rollout's of every layer (r3, algo/train_batch.py; the actor takes its pipeline stage's)."""

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def generated(self) -> torch.Tensor:
        """[B, S] bool: the generated tokens (response_mask; the loss mask's when there is none)."""
        return (self.loss_mask if self.response_mask is None else self.response_mask) > 0

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])
