"""The SGLang engine's streaming rollout: one /generate call per group, at most `concurrency` at once.

Each group is one POST of its n requests (prompt repeated, request k with sampling_seed seed + k and
request id `<stream>:<key>:<k>:`, none the prefix of another: SGLang aborts by prefix), made from a worker
thread through the server's bounded HTTP layer; the server batches all of them continuously, and a group
comes back as soon as its n samples are done.
`abort()` cancels the groups not yet sent and sends /abort_request for every request id of the
running ones (again each second until their calls return, for an abort that reached the server
before its request): SGLang then answers those calls at once with finish_reason "abort" and the
tokens generated so far, which the report counts and hands back (`AbortReport.partial`, with their
logprobs). Other streams' and callers' requests are untouched, and the engine stays usable. A resumed
group (`GroupRequest.resume`, partial rollout) sends only its unfinished samples, each as prompt +
response so far with the rest of its max_new_tokens.

Reproducibility: SGLang honours `sampling_seed` only with --enable-deterministic-inference (train.deterministic
passes it on a GPU), which needs a GPU attention backend (fa3, flashinfer, triton); on the CPU engine
(torch_native) it refuses that flag, so CPU samples are not reproducible. A server that dies fails its group's call with
`SGLangServerError` naming it, raised by `next()`.
"""

from __future__ import annotations

import itertools
import os
import secrets
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

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
from megatron_dapo.rollout.sglang.server import SGLangServer
from megatron_dapo.rollout.sglang.wire import (
    continue_body,
    cut_at_stop,
    generate_body,
    generated_tokens,
    parse_generate_response,
)
from megatron_dapo.types import Sample

_STREAMS = itertools.count()
_ABORT_WAIT_S = 120.0
"""How long abort() waits for the aborted calls to return (a live server answers within a step). Calls still
running after it keep the server busy: the engine's sleep() waits for its idle report (SGLangEngine.wait_idle)."""
_ABORT_THREADS = 8


@dataclass
class _Cancelled:
    """A group whose call came back aborted: the tokens generated for it before the abort, and its n
    samples as far as they got (finished, or finish_reason "abort")."""

    tokens: int
    samples: list[Sample]


class SGLangStream(RolloutStream):
    """Per-group /generate calls on `server` (see the module docstring)."""

    def __init__(self, server: SGLangServer, concurrency: int = 256) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency={concurrency} must be >= 1")
        self._server = server
        self._id = f"dapo-{os.getpid()}-{next(_STREAMS)}-{secrets.token_hex(3)}"
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="sglang-stream")
        self._cond = threading.Condition()
        self._futures: dict[int, Future] = {}  # pending groups of the current epoch
        self._ready: dict[int, Any] = {}  # their results, in arrival order
        self._failed: dict[int, BaseException] = {}  # groups whose call failed (raised by next())
        self._requests: dict[int, GroupRequest] = {}  # the pending groups' requests
        self._running: dict[tuple[int, int], list[str]] = {}  # (epoch, key) -> request ids in flight
        self._late: dict[int, dict[int, Any]] = {}  # epoch -> key -> what its call returned after abort()
        self._epoch = 0  # bumped by abort(): calls of an older epoch report to _late

    @property
    def pending(self) -> int:
        return len(self._futures)

    def submit(self, requests: Sequence[GroupRequest]) -> None:
        with self._cond:
            for r in requests:
                if r.key in self._futures:
                    raise ValueError(f"group key {r.key} is already pending in this stream")
                self._requests[r.key] = r
                self._futures[r.key] = self._pool.submit(self._run, r, self._epoch)

    def next(self) -> GroupResult:
        with self._cond:
            if not self._futures:
                raise EngineStateError(f"SGLang stream on {self._server.url}: no group is pending")
            epoch = self._epoch
            while not self._ready:  # every call delivers a result; every call is bounded
                if self._failed and len(self._failed) == len(self._futures):
                    raise next(iter(self._failed.values()))
                self._cond.wait()
                if self._epoch != epoch:
                    raise GenerationAborted(f"the stream on {self._server.url} was aborted")
            key = next(iter(self._ready))
            item = self._ready.pop(key)
            if isinstance(item, BaseException):  # the group stays pending (abort() reports it)
                self._failed[key] = item
                raise item
            del self._futures[key]
            del self._requests[key]
        if isinstance(item, _Cancelled):
            raise GenerationAborted(f"group {key} was aborted on {self._server.url}")
        return item

    def abort(self) -> AbortReport:
        with self._cond:
            futures, ready, requests = self._futures, self._ready, self._requests
            self._futures, self._ready, self._failed, self._requests = {}, {}, {}, {}
            epoch = self._epoch
            self._epoch += 1
            self._late[epoch] = {}
            self._cond.notify_all()
        for fut in futures.values():
            fut.cancel()  # groups not yet sent never are
        self._abort_running(futures, epoch)
        with self._cond:
            late = self._late.pop(epoch)
        tokens = sum(_new_tokens(requests[key], item) for key, item in [*ready.items(), *late.items()])
        partial = {key: _so_far(requests[key], ready.get(key, late.get(key))) for key in futures}
        return AbortReport(keys=sorted(futures), tokens=tokens, partial=partial)

    def close(self) -> None:
        super().close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ----------------------------------------------------------------------------------- internal

    def _abort_running(self, futures: dict[int, Future], epoch: int) -> None:
        """/abort_request each running request until every call of `epoch` has returned (bounded)."""
        deadline = time.monotonic() + _ABORT_WAIT_S
        with ThreadPoolExecutor(max_workers=_ABORT_THREADS, thread_name_prefix="sglang-abort") as pool:
            while True:
                not_done = [f for f in futures.values() if not f.done()]
                if not not_done or time.monotonic() > deadline:
                    return
                with self._cond:
                    rids = [rid for (e, _), rids in self._running.items() if e == epoch for rid in rids]
                if rids and self._server.dead_reason() is None:
                    list(pool.map(self._abort_one, rids))
                wait(not_done, timeout=1.0)

    def _abort_one(self, rid: str) -> None:
        """One plain bounded request (no watcher thread): a dead server fails the group's own call."""
        with suppress(Exception):
            self._server._http("POST", "/abort_request", {"rid": rid}, timeout=30)

    def _run(self, r: GroupRequest, epoch: int) -> None:
        todo = [k for k in range(r.n) if not r.resume or r.resume[k].finish_reason == "abort"]
        rids = [f"{self._id}:{r.key}:{k}:" for k in todo]  # SGLang aborts every rid that starts with the one named
        with self._cond:
            if epoch != self._epoch:
                return
            self._running[(epoch, r.key)] = rids
        try:
            item: Any = GroupResult(key=r.key, samples=list(r.resume))
            if todo:
                item = self._call(r, todo, rids)
        except BaseException as e:  # noqa: BLE001 - raised by next() in the consumer's thread
            item = e
        with self._cond:
            self._running.pop((epoch, r.key), None)
            if epoch == self._epoch:
                self._ready[r.key] = item
                self._cond.notify_all()
            elif isinstance(item, (GroupResult, _Cancelled)) and epoch in self._late:
                self._late[epoch][r.key] = item

    def _call(self, r: GroupRequest, todo: list[int], rids: list[str]) -> GroupResult | _Cancelled:
        """One /generate call for samples `todo` of the group (all, or a resumed group's unfinished ones)."""
        if r.resume:
            body, cut_at = continue_body(r.prompt_ids, [(k, r.resume[k]) for k in todo], r.sampling, rids)
        else:
            body, _, cut_at = generate_body([r.prompt_ids], r.n, r.sampling, rids)
        payload = self._server.post("/generate", body)
        read = body["input_ids"]  # a continued sample's input: prompt + response so far
        new = parse_generate_response(payload, read, aborted_ok=True, vocab_size=self._server.vocab_size,
                                      routes=self._server.routes_of(r.sampling))
        if cut_at:  # a carried-in response holds no stop token: only the new tokens are cut
            new = [cut_at_stop(s, cut_at) for s in new]
        for s in new:
            s.prompt_ids = list(r.prompt_ids)
        samples = list(r.resume) or [None] * r.n
        for k, s in zip(todo, new):
            samples[k] = _settled(_joined(r.resume[k], s) if r.resume else s, r.sampling)
        if any(s.finish_reason == "abort" for s in samples):
            return _Cancelled(generated_tokens(payload), samples)
        return GroupResult(key=r.key, samples=samples)


def _settled(sample: Sample, sampling: SamplingParams) -> Sample:
    """An answer marked "abort" that reached max_new_tokens or ends in a stop token is finished: an abort
    that meets a request in its last step can come back as "abort" with every token."""
    if sample.finish_reason == "abort":
        if sample.response_ids and sample.response_ids[-1] in sampling.stop_token_ids:
            sample.finish_reason = "stop"
        elif sample.response_len >= sampling.max_new_tokens:
            sample.finish_reason = "length"
    return sample


def _joined(before: Sample, after: Sample) -> Sample:
    """A continued sample: `after` read prompt + `before`'s response (its routes: continued_routes)."""
    return Sample(prompt_ids=list(before.prompt_ids), response_ids=before.response_ids + after.response_ids,
                  rollout_logprobs=before.rollout_logprobs + after.rollout_logprobs,
                  finish_reason=after.finish_reason, routes=continued_routes(before, after.routes))


def _new_tokens(r: GroupRequest, item: Any) -> int:
    """Tokens a call generated (a finished resumed group's responses include what it carried in)."""
    if isinstance(item, _Cancelled):
        return item.tokens
    return item.tokens - r.resumed_tokens if isinstance(item, GroupResult) else 0


def _so_far(r: GroupRequest, item: Any) -> list[Sample]:
    """A cancelled group's samples: what its call returned, else as it was submitted (never sent, failed)."""
    if isinstance(item, (GroupResult, _Cancelled)):
        return list(item.samples)
    return [r.initial(k) for k in range(r.n)]
