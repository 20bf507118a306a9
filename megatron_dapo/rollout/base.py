"""The one interface every rollout engine implements (embedded, SGLang).

The trainer only talks to `RolloutEngine`: generate G samples per prompt with per-token logprobs,
release memory around training (`sleep`/`wake`), take fresh weights as a stream of HF-named
tensors (`update_weights`), drop leftovers (`abort`), and report liveness (`health`).

Besides the blocking `generate`, `stream()` opens a `RolloutStream`: submit groups (`GroupRequest`: a
prompt, n, sampling with the group's own seed), receive each GROUP as soon as its n samples are
finished, in completion order, and `abort()` what is left, learning what was cancelled. A group's
samples depend only on its request (its seed), never on what else runs beside it, as far as the
engine's arithmetic is batch-invariant (see each engine).

Logprob semantics (all engines): `Sample.rollout_logprobs[t]` is
log softmax(logits_t / temperature)[o_t], the temperature-scaled distribution BEFORE top-p
truncation, which is what SGLang returns by default. With temperature 0 (greedy) it is the plain
log softmax(logits_t)[o_t]. The actor must compute pi_old with the same temperature to match.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import torch

from megatron_dapo.config import RolloutConfig
from megatron_dapo.types import Sample


MEMORY_TAGS = ("weights", "kv_cache")
"""What an engine releases and resumes separately (SGLang's memory tags): sleep/wake(tags=None) = all."""


def check_tags(tags: Sequence[str] | None) -> tuple[str, ...]:
    """The tags a sleep/wake call means (None = all); an unknown tag is a ValueError."""
    if tags is None:
        return MEMORY_TAGS
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise ValueError(f"unknown memory tags {bad}; valid: {', '.join(MEMORY_TAGS)}")
    return tuple(t for t in MEMORY_TAGS if t in tags)


class EngineStateError(RuntimeError):
    """The engine cannot serve the call in its current state (asleep, shut down, busy)."""


class GenerationAborted(RuntimeError):
    """`abort()` was called while `generate` was running; its unfinished requests were dropped."""


class NonFiniteLogitsError(RuntimeError):
    """The engine's policy gave inf/NaN logits (a server: NaN logprobs, or token ids outside the vocabulary,
    which is what sampling from NaN probabilities returns): its weights are unusable. Never retried."""


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    temperature: float = 1.0
    """0 = greedy (argmax); otherwise logits are divided by it before softmax."""
    top_p: float = 1.0
    """Nucleus sampling: sample among the smallest token set whose probability mass reaches top_p."""
    max_new_tokens: int = 1024
    """Response length limit; a response that reaches it finishes with reason "length" (truncated)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop tokens besides the model's EOS; the stop token is kept in the response."""
    ignore_eos: bool = False
    """Do not stop on the model's EOS token(s) (stop_token_ids still apply); as SGLang's ignore_eos."""
    seed: int | None = None
    """Seeds sampling: the same seed, prompts and engine settings give the same samples."""
    return_routes: bool = False
    """A mixture-of-experts model's routing of every token it read (Sample.routes), as SGLang's
    return_routed_experts: rollout routing replay (actor.routing_replay=r3) trains on it."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p={self.top_p} must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens} must be >= 1")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_config(
        cls, cfg: RolloutConfig, *, stop_token_ids: Sequence[int] = (), seed: int | None = None
    ) -> SamplingParams:
        """Training-rollout sampling from the rollout sub-config."""
        return cls(
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_new_tokens=cfg.max_response_len,
            stop_token_ids=tuple(stop_token_ids),
            seed=seed,
        )


def check_prompts(prompt_token_ids: Sequence[Sequence[int]], n: int) -> None:
    """Reject malformed requests before any work starts; the message names the bad prompt."""
    if n < 1:
        raise ValueError(f"n={n}: need at least one sample per prompt")
    for i, ids in enumerate(prompt_token_ids):
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")


@dataclass(frozen=True, kw_only=True)
class GroupRequest:
    """n samples of one prompt for a stream; `key` (the caller's group index) names it in results, aborts."""

    key: int
    prompt_ids: Sequence[int]
    """Any sequence of ints; kept as a tuple."""
    n: int
    sampling: SamplingParams
    """Per group: with a seed, sample k of the group draws from a random stream keyed by (seed + k)."""
    resume: tuple[Sample, ...] = ()
    """Partial rollout: the group's n samples as an aborted stream left them (`AbortReport.partial`). A
    finished one ("stop"/"length") comes back as it is; an "abort" one continues from its response so
    far, which counts toward max_new_tokens."""
    carried_steps: int = 0
    """Partial rollout: how many steps the group has been carried into (the loop's staleness count;
    engines ignore it)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        object.__setattr__(self, "resume", tuple(self.resume))
        check_prompts([self.prompt_ids], self.n)
        if self.resume:
            check_resume(self)

    @property
    def resumed_tokens(self) -> int:
        """Response tokens the group carries in from an earlier stream."""
        return sum(s.response_len for s in self.resume)

    def initial(self, k: int) -> Sample:
        """Sample k before this stream made any token of it: as carried in, else an empty "abort" one."""
        if self.resume:
            return self.resume[k]
        return Sample(prompt_ids=list(self.prompt_ids), response_ids=[], rollout_logprobs=[],
                      finish_reason="abort")


def check_resume(r: GroupRequest) -> None:
    if len(r.resume) != r.n:
        raise ValueError(f"group {r.key}: resume has {len(r.resume)} samples, n={r.n}")
    for k, s in enumerate(r.resume):
        if tuple(s.prompt_ids) != r.prompt_ids:
            raise ValueError(f"group {r.key}: resumed sample {k} belongs to another prompt")
        if len(s.rollout_logprobs) != s.response_len:
            raise ValueError(f"group {r.key}: resumed sample {k} has {s.response_len} tokens but "
                             f"{len(s.rollout_logprobs)} logprobs")
        if s.finish_reason == "abort" and s.response_len >= r.sampling.max_new_tokens:
            raise ValueError(f"group {r.key}: resumed sample {k} already has {s.response_len} tokens "
                             f"(max_new_tokens {r.sampling.max_new_tokens})")


def continued_routes(before: Sample, routes: torch.Tensor | None) -> torch.Tensor | None:
    """The routes of a continued sample (partial rollout, stream mode): `routes` (every position its continuation
    read: prompt + `before`'s response and on) with `before`'s up to its last token kept, since the weights that
    generated a token routed the positions before it. `routes` as they are where `before` came without any."""
    if routes is None or before.routes is None:
        return routes
    kept = len(before.prompt_ids) + before.response_len - 1
    return torch.cat([before.routes[:kept], routes[kept:]])


@dataclass
class GroupResult:
    """A finished group: its n samples in sample order."""

    key: int
    samples: list[Sample]

    @property
    def tokens(self) -> int:
        return sum(s.response_len for s in self.samples)


@dataclass
class AbortReport:
    """What `RolloutStream.abort()` cancelled."""

    keys: list[int]
    """The groups submitted and not returned by `next()`, in key order (queued, running, or finished
    but not yet collected)."""
    tokens: int
    """Tokens generated for those groups before the abort (partial and finished responses), not counting
    what their requests carried in (`GroupRequest.resume`)."""
    partial: dict[int, list[Sample]] = field(default_factory=dict)
    """Engines that support partial rollout: each cancelled group's n samples so far, finished ones as
    they are and unfinished ones with finish_reason "abort" (possibly empty), for `GroupRequest.resume`."""


class RolloutStream(ABC):
    """Groups in, finished groups out in completion order; one stream per engine at a time.

    `next()` and `submit()` belong to one thread; `abort()` may also come from another thread, and then
    a `next()` running there raises GenerationAborted. After `abort()` the stream is empty and usable.
    """

    @abstractmethod
    def submit(self, requests: Sequence[GroupRequest]) -> None:
        """Queue groups; they start as the engine has room. Keys must be unique among pending groups."""

    @abstractmethod
    def next(self) -> GroupResult:
        """The next finished group (blocks, bounded by the engine's own timeouts). Raises
        EngineStateError when nothing is pending; an engine failure propagates, naming the engine."""

    @property
    @abstractmethod
    def pending(self) -> int:
        """Groups submitted and not yet returned by `next()` or cancelled."""

    @abstractmethod
    def abort(self) -> AbortReport:
        """Cancel every pending group and report them (also usable after an engine failure)."""

    def close(self) -> None:
        """Abort what is pending; the stream is closed (its engine can open a new one)."""
        if self.pending:
            self.abort()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class RolloutEngine(ABC):
    """Generates groups of samples and takes weight updates; usable as a context manager."""

    @abstractmethod
    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: SamplingParams
    ) -> list[list[Sample]]:
        """n samples per prompt, in prompt order; each with response ids, logprobs, finish reason.

        finish_reason is "stop" when a stop/EOS token was sampled (kept in response_ids, with its
        logprob) and "length" when max_new_tokens was reached (truncated).
        """

    def stream(self) -> RolloutStream:
        """Open a `RolloutStream`; an engine that cannot stream raises NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} has no streaming rollout")

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the engine's weights, consuming the iterable as a stream.

        Raises KeyError for an unknown name and ValueError for a shape mismatch, naming the tensor.
        Tensors before the bad one are already applied: resync all weights after such an error.
        """

    @abstractmethod
    def sleep(self, tags: Sequence[str] | None = None) -> None:
        """Release device memory for training (colocated mode); generate refuses until all is awake.
        `tags` (MEMORY_TAGS): release only those; None = everything."""

    @abstractmethod
    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Retake the memory released by sleep(): only `tags` (e.g. the weights, to take new ones before
        the KV cache comes back), None = everything still released."""

    def resident_bytes(self) -> dict[str, int]:
        """Bytes the engine holds on its device(s) now, by memory tag (released ones: 0); {} = unknown.
        For the phase ledger: what the colocated engine occupies next to the actor."""
        return {}

    def score(self, token_ids: Sequence[int], start: int) -> list[list[float]]:
        """Teacher-forced log p(token t | tokens < t) at temperature 1 for t = start .. len - 1, once per
        model copy the engine drives (each server of a group): the weight-sync probe compares them with
        the actor's."""
        raise NotImplementedError(f"{type(self).__name__} cannot score tokens")

    @abstractmethod
    def abort(self) -> None:
        """Drop unfinished requests; their generate call raises GenerationAborted."""

    @abstractmethod
    def health(self) -> bool:
        """True when the engine can serve requests (possibly after wake())."""

    @abstractmethod
    def shutdown(self) -> None:
        """Free everything; idempotent. The engine is unusable afterwards."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()
