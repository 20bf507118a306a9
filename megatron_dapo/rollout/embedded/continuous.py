"""The embedded engine's streaming rollout: continuous batching of submitted groups.

Each `next()` runs decode steps until a group is complete. A step admits waiting sample rows into
the free rows of the decoder (each new prompt prefilled once, its KV copied to its rows), samples one
token for every running row, finishes rows that hit a stop token or their max_new_tokens (a group is
done when its n rows are), releases their rows, and feeds the rest one token. With the Llama-family
`SlotDecoder` a finished row's slot is refilled at the next step; other models run in waves
(`WaveDecoder`). The KV budget is the engine's `max_batch_tokens`.

Reproducibility: a row draws its token t from `counter_uniforms(seed + k, t)` (group seed, sample k),
so its tokens are a pure function of its group's request and the logits. The logits of a row do not
depend on the other rows up to float rounding in batched matmuls (tests: identical tokens, logprobs
within 1e-5, across batch compositions). Without a seed, the stream draws one per group.

Partial rollout: `abort()` reports every pending group's samples so far (`AbortReport.partial`); a
request that carries them (`GroupRequest.resume`) prefills each unfinished row's prompt + response and
goes on drawing from token index len(response): the continuation an uninterrupted stream would sample.
"""

from __future__ import annotations

import secrets
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from megatron_dapo.rollout.base import (
    AbortReport,
    EngineStateError,
    GenerationAborted,
    GroupRequest,
    GroupResult,
    RolloutStream,
    SamplingParams,
    continued_routes,
)
from megatron_dapo.rollout.embedded.routes import read_routes
from megatron_dapo.rollout.embedded.sampling import counter_uniforms, sample_next
from megatron_dapo.rollout.embedded.slots import RowDecoder
from megatron_dapo.types import FinishReason, Sample


@dataclass
class _Row:
    key: int
    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    start: int = 0
    """Tokens the row carried in (a resumed sample's response so far)."""


@dataclass
class _Group:
    request: GroupRequest
    seed: int
    samples: list[Sample | None]
    left: int
    generated: int = 0
    """Tokens of its samples finished in this stream (carried-in tokens excluded)."""

    def prior(self, index: int) -> Sample | None:
        """The resumed sample `index` (partial rollout), if the request carries one."""
        return self.request.resume[index] if self.request.resume else None


class EmbeddedStream(RolloutStream):
    """Continuous batching over `decoder` (see the module docstring).

    `eos`: the model's EOS ids (stop unless a request ignores EOS). `vocab`: the logits' width.
    `engine_lock` is held for each decode step (no weight update or blocking generate mid-step);
    `ready()` raises when the engine cannot run (asleep, shut down); `check_prompts(prompts)` validates
    token ids; `on_close(decoder)` takes the decoder back (its KV memory serves the engine's next stream).
    All requests of a stream share temperature and top-p.
    """

    def __init__(self, decoder: RowDecoder, *, eos: set[int], vocab: int, device: torch.device,
                 engine_lock: threading.Lock, ready: Callable[[], None],
                 check_prompts: Callable[[Sequence[Sequence[int]]], None],
                 on_close: Callable[[RowDecoder], None] = lambda decoder: None) -> None:
        self._decoder, self._eos, self._vocab, self._device = decoder, set(eos), vocab, device
        self._engine_lock, self._ready, self._check_prompts = engine_lock, ready, check_prompts
        self._on_close = on_close
        self._queue_lock = threading.Lock()  # _groups, _waiting, _done, _need (submit vs the pump)
        self._pump = threading.Lock()  # one next() at a time; abort() waits for it
        self._abort = threading.Event()
        self._groups: dict[int, _Group] = {}
        self._waiting: deque[tuple[int, int]] = deque()
        self._done: deque[GroupResult] = deque()
        self._need = 1
        self._sampling: SamplingParams | None = None
        self._stop_sets: dict[frozenset[int], int] = {}
        self._stop_table = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self._reset_rows()

    def _reset_rows(self) -> None:
        self._rows: list[_Row] = []
        self._logits: Tensor | None = None
        empty = torch.zeros(0, dtype=torch.long, device=self._device)
        self._seed, self._count, self._max_new, self._stop = empty, empty, empty, empty

    # ------------------------------------------------------------------------------------- API

    @property
    def pending(self) -> int:
        return len(self._groups)

    def submit(self, requests: Sequence[GroupRequest]) -> None:
        self._check_prompts([r.prompt_ids for r in requests])
        with self._queue_lock:
            for r in requests:
                self._check_request(r)
                seed = r.sampling.seed if r.sampling.seed is not None else secrets.randbits(62)
                group = self._groups[r.key] = _Group(r, seed, [None] * r.n, r.n)
                for k in range(r.n):
                    prior = group.prior(k)
                    if prior is not None and prior.finish_reason != "abort":
                        group.samples[k], group.left = prior, group.left - 1
                    else:
                        self._waiting.append((r.key, k))
                if group.left == 0:
                    self._done.append(GroupResult(key=r.key, samples=list(group.samples)))
                self._need = max(self._need, len(r.prompt_ids) + r.sampling.max_new_tokens)

    def next(self) -> GroupResult:
        with self._pump:
            while True:
                with self._queue_lock:
                    if self._done:
                        result = self._done.popleft()
                        del self._groups[result.key]
                        return result
                    if not self._groups:
                        raise EngineStateError("EmbeddedStream.next(): no group is pending")
                if self._abort.is_set():
                    raise GenerationAborted("the stream was aborted")
                with self._engine_lock, torch.inference_mode():
                    self._ready()
                    self._advance()

    def abort(self) -> AbortReport:
        self._abort.set()
        with self._pump:
            with self._queue_lock:
                keys = sorted(self._groups)
                tokens = sum(len(r.tokens) - r.start for r in self._rows) + sum(
                    g.generated for g in self._groups.values())
                partial = self._partial()
                self._groups.clear()
                self._waiting.clear()
                self._done.clear()
            if self._decoder.rows:
                self._decoder.release(torch.ones(self._decoder.rows, dtype=torch.bool, device=self._device))
            self._reset_rows()
            self._abort.clear()
        return AbortReport(keys=keys, tokens=tokens, partial=partial)

    def _partial(self) -> dict[int, list[Sample]]:
        """Each pending group's samples so far: finished, running (cut short) or waiting (as submitted)."""
        out = {key: list(g.samples) for key, g in self._groups.items()}
        for i, row in enumerate(self._rows):
            out[row.key][row.index] = self._sample(row, "abort", self._routes(i, row))
        for key, samples in out.items():
            request = self._groups[key].request
            for k, s in enumerate(samples):
                if s is None:
                    samples[k] = request.initial(k)
        return out

    def _sample(self, row: _Row, reason: FinishReason, routes: Tensor | None) -> Sample:
        """Row's sample; its routes (`routes`: at every position it read) keep a resumed sample's carried ones up to
        its last carried token: the weights that generated a token routed the positions before it."""
        group = self._groups[row.key]
        prompt, prior = group.request.prompt_ids, group.prior(row.index)
        routes = read_routes(routes, len(prompt) + len(row.tokens))
        if row.start and prior is not None:
            routes = continued_routes(prior, routes)
        return Sample(prompt_ids=list(prompt), response_ids=list(row.tokens),
                      rollout_logprobs=list(row.logprobs), finish_reason=reason, routes=routes)

    def _routes(self, i: int, row: _Row) -> Tensor | None:
        """Decoder row i's routes, if its request asked for them."""
        return self._decoder.routes(i) if self._groups[row.key].request.sampling.return_routes else None

    def close(self) -> None:
        """Abort what is pending and hand the (empty) decoder back to the engine for its next stream."""
        super().close()
        with self._pump:
            if not self._decoder.rows:
                self._on_close(self._decoder)

    def _check_request(self, r: GroupRequest) -> None:
        if r.key in self._groups:
            raise ValueError(f"group key {r.key} is already pending in this stream")
        s = self._sampling
        if s is None:
            self._sampling = r.sampling
        elif (s.temperature, s.top_p) != (r.sampling.temperature, r.sampling.top_p):
            raise ValueError(f"group {r.key}: temperature/top_p {r.sampling.temperature}/{r.sampling.top_p} "
                             f"differ from the stream's {s.temperature}/{s.top_p}")

    # ------------------------------------------------------------------------------ one step

    def _advance(self) -> None:
        """Admit waiting rows, sample a token for every running row, finish rows, feed the rest."""
        self._admit()
        if self._logits is None:
            return
        uniforms = None if self._sampling.greedy else counter_uniforms(self._seed, self._count)
        tokens, logprobs = sample_next(self._logits, self._sampling, None, uniforms)
        for row, t, lp in zip(self._rows, tokens.tolist(), logprobs.tolist()):
            row.tokens.append(t)
            row.logprobs.append(lp)
        self._count = self._count + 1
        hit = self._stop_table[self._stop, tokens]
        done = hit | (self._count >= self._max_new)
        if bool(done.any()):
            for i in done.nonzero().squeeze(1).tolist():
                self._finish(self._rows[i], stopped=bool(hit[i]), routes=self._routes(i, self._rows[i]))
            order = self._decoder.release(done)
            self._rows = [self._rows[i] for i in order.tolist()]
            self._seed, self._count = self._seed[order], self._count[order]
            self._max_new, self._stop, tokens = self._max_new[order], self._stop[order], tokens[order]
        self._logits = self._decoder.step(tokens) if self._decoder.rows else None

    def _finish(self, row: _Row, stopped: bool, routes: Tensor | None) -> None:
        with self._queue_lock:
            group = self._groups[row.key]
            group.samples[row.index] = self._sample(row, "stop" if stopped else "length", routes)
            group.generated += len(row.tokens) - row.start
            group.left -= 1
            if group.left == 0:
                self._done.append(GroupResult(key=row.key, samples=list(group.samples)))

    def _admit(self) -> None:
        """Fill free decoder rows with waiting sample rows, prompt-major (one prefill per prompt)."""
        with self._queue_lock:
            need, waiting = self._need, len(self._waiting)
        if not waiting:
            return
        self._decoder.reserve(need, self._decoder.rows + waiting)
        with self._queue_lock:
            take = [self._waiting.popleft() for _ in range(min(self._decoder.free, len(self._waiting)))]
            groups = {key: self._groups[key] for key, _ in take}
        if not take:
            return
        # Fresh rows share one prefill per prompt; a resumed row prefills its prompt + response so far.
        def carried(key: int, k: int) -> Sample | None:
            p = groups[key].prior(k)
            return p if p is not None and p.response_len else None

        resumed = [(key, k, p) for key, k in take if (p := carried(key, k)) is not None]
        fresh = [(key, k) for key, k in take if carried(key, k) is None]
        counts = Counter(key for key, _ in fresh)
        rank = {key: i for i, key in enumerate(counts)}
        fresh.sort(key=lambda row: (rank[row[0]], row[1]))
        prompts = [groups[key].request.prompt_ids for key in counts] + [
            (*groups[key].request.prompt_ids, *p.response_ids) for key, _, p in resumed]
        record = any(g.request.sampling.return_routes for g in groups.values())
        logits = self._decoder.admit(prompts, list(counts.values()) + [1] * len(resumed), record)
        self._logits = logits if self._logits is None else torch.cat([self._logits, logits])
        self._rows += [_Row(key, index) for key, index in fresh] + [
            _Row(key, k, list(p.response_ids), list(p.rollout_logprobs), p.response_len)
            for key, k, p in resumed]
        new = [(groups[key], index) for key, index in fresh] + [(groups[key], k) for key, k, _ in resumed]
        self._seed = self._cat(self._seed, [g.seed + k for g, k in new])
        self._count = self._cat(self._count, [0] * len(fresh) + [p.response_len for _, _, p in resumed])
        self._max_new = self._cat(self._max_new, [g.request.sampling.max_new_tokens for g, _ in new])
        self._stop = self._cat(self._stop, [self._stop_index(g.request.sampling) for g, _ in new])

    def _cat(self, t: Tensor, values: list[int]) -> Tensor:
        return torch.cat([t, torch.tensor(values, dtype=torch.long, device=self._device)])

    def _stop_index(self, sampling: SamplingParams) -> int:
        """Row of the stop-token table for this sampling (its stop ids, plus EOS unless ignored)."""
        eos = frozenset() if sampling.ignore_eos else frozenset(self._eos)
        stop = frozenset(sampling.stop_token_ids) | eos
        if stop not in self._stop_sets:
            row = torch.zeros(1, self._vocab, dtype=torch.bool, device=self._device)
            row[0, [t for t in stop if 0 <= t < self._vocab]] = True
            self._stop_table = torch.cat([self._stop_table, row])
            self._stop_sets[stop] = len(self._stop_sets)
        return self._stop_sets[stop]
