"""Scripted rollout engines for the restart tests (tests/test_engine_restarts.py, tests/test_engine_refresh.py):
restartable as an SGLang server is (lost / kill / restart / stale_weights), with samples that are a function of their
request (prompt, seed), so the groups a run receives can be checked against what one undisturbed engine gives."""

from __future__ import annotations

import threading
import time

from megatron_dapo.rollout.base import AbortReport, GroupRequest, GroupResult, RolloutEngine, RolloutStream, SamplingParams
from megatron_dapo.types import Sample

N = 3


def scripted(prompt, seed: int, k: int) -> Sample:
    """Sample k of a group: what any engine, undisturbed, returns for (prompt, seed)."""
    return Sample(prompt_ids=list(prompt), response_ids=[seed + k, sum(prompt)], rollout_logprobs=[-1.0, -2.0],
                  finish_reason="stop")


def request(key: int) -> GroupRequest:
    return GroupRequest(key=key, prompt_ids=[key + 1, 7], n=N, sampling=SamplingParams(seed=1000 + 10 * key))


def expected(key: int) -> list[Sample]:
    r = request(key)
    return [scripted(r.prompt_ids, r.sampling.seed, k) for k in range(N)]


class ScriptedStream(RolloutStream):
    def __init__(self, engine: Scripted) -> None:
        self.engine, self.cond = engine, threading.Condition()
        self.queue: list[GroupRequest] = []

    @property
    def pending(self) -> int:
        return len(self.queue)

    def submit(self, requests):
        with self.cond:
            self.queue += list(requests)
            self.cond.notify_all()

    def next(self):
        self.engine.check_alive()
        if self.engine.delivered == self.engine.dies_after:
            self.engine.dead = True  # the server process is gone (SIGKILL, OOM)
            self.engine.check_alive()
        time.sleep(0.01)
        with self.cond:
            r = self.queue.pop(0)
        self.engine.delivered += 1
        self.engine.served.append(r.key)
        return GroupResult(key=r.key, samples=[scripted(r.prompt_ids, r.sampling.seed, k) for k in range(r.n)])

    def abort(self):
        with self.cond:
            keys, self.queue = sorted(r.key for r in self.queue), []
        return AbortReport(keys=keys, tokens=0)


class Scripted(RolloutEngine):
    """A restartable engine (as SGLangEngine: lost / kill / restart / stale_weights) that dies after
    delivering `dies_after` groups."""

    def __init__(self, dies_after: int | None = None) -> None:
        self.dies_after, self.delivered, self.dead = dies_after, 0, False
        self.served: list[int] = []
        self.stale_weights, self.restarted, self.killed = False, 0, 0

    def check_alive(self):
        if self.dead:
            raise RuntimeError("SGLang server exited with code -9 while serving POST /generate")

    def lost(self):
        return "exited with code -9" if self.dead else None

    def kill(self):
        self.killed += 1

    def restart(self):
        time.sleep(0.05)
        self.dead, self.dies_after, self.stale_weights = False, None, True
        self.restarted += 1

    def log_tail(self):
        return "line one\nCUDA error: an illegal memory access was encountered"

    def generate(self, prompts, n, sampling):
        if self.dies_after == 0:
            self.dead = True
        self.check_alive()
        return [[scripted(p, sampling.seed + i * n, k) for k in range(n)] for i, p in enumerate(prompts)]

    def stream(self):
        return ScriptedStream(self)

    def update_weights(self, named_tensors):
        list(named_tensors)
        self.stale_weights = False

    sleep = wake = abort = shutdown = lambda self, *a: None  # type: ignore[assignment]

    def health(self):
        return not self.dead


def drain(stream, count: int) -> dict[int, list[Sample]]:
    out = {}
    for _ in range(count):
        r = stream.next()
        assert r.key not in out, f"group {r.key} delivered twice"
        out[r.key] = r.samples
    assert stream.pending == 0
    return out
