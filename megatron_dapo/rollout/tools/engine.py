"""`ToolEngine`: any rollout engine's `generate`, made multi-turn (rollout.tools).

A call samples every row until it closes a code block, EOS, or the budget; the blocks of all rows that closed
one run together (the tool is asynchronous: the sandbox pool runs them in parallel); each observation is
appended as token ids, and the rows still open continue in one batched `generate` from their ids, up to
`max_calls` calls each. Round r > 0 of a seeded call samples with seed + r * SEED_STRIDE, so a call is
reproducible. Weights, memory, liveness and restarts are the wrapped engine's: an SGLang engine group continues
each row from its token ids (`/generate` with `input_ids`), as the embedded engines do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future

import torch

from megatron_dapo.config.tools import ToolsConfig
from megatron_dapo.rollout.base import (AbortReport, EngineStateError, GroupRequest, GroupResult, RolloutEngine,
                                        RolloutStream, SamplingParams, check_prompts)
from megatron_dapo.rollout.restarts import stale_engines
from megatron_dapo.rollout.tools.turns import Conversation, close_stop_ids
from megatron_dapo.sandbox.types import ToolResult
from megatron_dapo.types import Sample

SEED_STRIDE = 1_000_003


class ToolEngine(RolloutEngine):
    """`inner` made multi-turn; `tool(code)` returns a Future of the call's ToolResult; `eos_ids`: the tokens that
    end a response (the tokenizer's EOS), told apart from the code-block stops; `on_shutdown` frees the tool."""

    def __init__(self, inner: RolloutEngine, cfg: ToolsConfig, tokenizer: object,
                 tool: Callable[[str], Future[ToolResult]], *, eos_ids: Iterable[int],
                 on_shutdown: Callable[[], None] | None = None) -> None:
        self.inner, self.cfg, self.tokenizer, self.tool = inner, cfg, tokenizer, tool
        self.close_ids = close_stop_ids(tokenizer, cfg.code_close)
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self._on_shutdown = on_shutdown

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], n: int,
                 sampling: SamplingParams) -> list[list[Sample]]:
        check_prompts(prompt_token_ids, n)
        convs = [Conversation(list(p), sampling.max_new_tokens) for p in prompt_token_ids for _ in range(n)]
        final = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else self.eos_ids)
        stops = tuple(sorted(final | self.close_ids))
        out = self.inner.generate(prompt_token_ids, n, dataclasses.replace(sampling, stop_token_ids=stops))
        segments, active, round_idx = [s for group in out for s in group], convs, 0
        while True:
            for conv, seg in zip(active, segments):
                conv.next_step(seg.response_ids, seg.rollout_logprobs, seg.finish_reason, tokenizer=self.tokenizer,
                               cfg=self.cfg, close_ids=self.close_ids, final_ids=final)
            self._run_tools([c for c in active if c.code is not None])
            active = [c for c in active if c.finish is None]
            if not active:
                break
            round_idx += 1
            seed = None if sampling.seed is None else sampling.seed + round_idx * SEED_STRIDE
            more = dataclasses.replace(sampling, stop_token_ids=stops, seed=seed,
                                       max_new_tokens=max(c.left for c in active))
            segments = [g[0] for g in self.inner.generate([c.context for c in active], 1, more)]
        return [[c.sample() for c in convs[i * n:(i + 1) * n]] for i in range(len(prompt_token_ids))]

    def _run_tools(self, calling: list[Conversation]) -> None:
        futures = [self.tool(c.code or "") for c in calling]  # all submitted before any is awaited
        for conv, fut in zip(calling, futures):
            conv.observe(fut.result(), tokenizer=self.tokenizer, cfg=self.cfg)

    def stream(self) -> RolloutStream:
        return ToolStream(self)

    # the wrapped engine's weights, memory and liveness
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.inner.update_weights(named_tensors)

    def sleep(self, tags: Sequence[str] | None = None) -> None:
        self.inner.sleep(tags)

    def wake(self, tags: Sequence[str] | None = None) -> None:
        self.inner.wake(tags)

    def resident_bytes(self) -> dict[str, int]:
        return self.inner.resident_bytes()

    def score(self, token_ids: Sequence[int], start: int) -> list[list[float]]:
        return self.inner.score(token_ids, start)

    def abort(self) -> None:
        self.inner.abort()

    def health(self) -> bool:
        return self.inner.health()

    def revive(self, remote: bool = False) -> None:
        """Restart what the wrapped engine lost between rollouts (an SGLang group's server, the process engine's
        child), if it restarts engines: the loop calls this at each phase change (EngineGroup.revive)."""
        revive = getattr(self.inner, "revive", None)
        if revive is not None:
            revive(remote=remote)

    def stale_part(self) -> RolloutEngine | None:
        """The wrapped engine's restarted engines that still hold stale weights (restarts.stale_engines)."""
        return stale_engines(self.inner)

    def shutdown(self) -> None:
        try:
            self.inner.shutdown()
        finally:
            if self._on_shutdown is not None:
                self._on_shutdown()
                self._on_shutdown = None


class ToolStream(RolloutStream):
    """Groups one at a time through `ToolEngine.generate` (each with its own sampling and seed, so a group's
    samples depend on its request only): the evaluation's stream. No partial rollout (refused by config)."""

    def __init__(self, engine: ToolEngine) -> None:
        self.engine = engine
        self.queue: list[GroupRequest] = []

    def submit(self, requests: Sequence[GroupRequest]) -> None:
        for r in requests:
            if r.resume:
                raise ValueError(f"group {r.key}: multi-turn rollouts do not resume partial groups")
        self.queue += list(requests)

    def next(self) -> GroupResult:
        if not self.queue:
            raise EngineStateError("ToolStream.next(): nothing pending")
        r = self.queue.pop(0)
        return GroupResult(r.key, self.engine.generate([r.prompt_ids], r.n, r.sampling)[0])

    @property
    def pending(self) -> int:
        return len(self.queue)

    def abort(self) -> AbortReport:
        keys, self.queue = sorted(r.key for r in self.queue), []
        return AbortReport(keys, 0)
