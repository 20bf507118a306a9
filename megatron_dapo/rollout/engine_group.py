"""Several rollout engines (e.g. one SGLang server per rollout TP group) behind one `RolloutEngine`.

generate() splits the prompts into contiguous, near-equal chunks, one per engine, runs them at once and
returns the groups in prompt order; a sampling seed is offset per chunk exactly as one engine would
offset it per sample, so the split does not change which seed a sample gets. update_weights() streams
every tensor to every engine at once through small per-engine queues (no copy of the model is held);
sleep / wake / abort / shutdown go to all engines. Any engine's failure stops the call and is raised
with the engine named; the other engines' requests are aborted. stream() spreads groups over the
engines' own streams by load (group_stream.py).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import Any

import torch

from megatron_dapo.rollout.base import RolloutEngine, RolloutStream, SamplingParams, check_prompts
from megatron_dapo.rollout.group_stream import GroupStream
from megatron_dapo.types import Sample

_END = object()
_QUEUE_DEPTH = 8
"""Tensors buffered per engine during a weight update (they are views of the exported weights)."""


class EngineGroupError(RuntimeError):
    """An engine of the group failed; the message names it."""


def split_evenly(count: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous [start, stop) ranges covering range(count), sizes differing by at most one."""
    return split_weighted(count, [1] * parts)


def split_weighted(count: int, weights: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous [start, stop) ranges covering range(count), sized in proportion to `weights` (the
    largest remainders get the leftover items, earlier parts first on ties)."""
    total = sum(weights)
    sizes = [count * w // total for w in weights]
    leftover = count - sum(sizes)
    by_remainder = sorted(range(len(weights)), key=lambda k: (-(count * weights[k] % total), k))
    for k in by_remainder[:leftover]:
        sizes[k] += 1
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


class EngineGroup(RolloutEngine):
    """`engines` (at least one) as one engine; `names` label them in errors (default: their url / class);
    `weights`: each engine's share of the prompts (default equal; e.g. a nested group's size)."""

    def __init__(self, engines: Sequence[RolloutEngine], names: Sequence[str] | None = None,
                 weights: Sequence[int] | None = None) -> None:
        if not engines:
            raise ValueError("EngineGroup needs at least one engine")
        if weights is not None and (len(weights) != len(engines) or min(weights) < 1):
            raise ValueError(f"weights {list(weights)} must be one positive integer per engine")
        self.engines = list(engines)
        self.weights = list(weights) if weights is not None else [1] * len(self.engines)
        self.names = list(names) if names is not None else [
            getattr(e, "url", f"{type(e).__name__}[{i}]") for i, e in enumerate(self.engines)]
        self._pool = ThreadPoolExecutor(max_workers=len(self.engines), thread_name_prefix="engine-group")

    def __len__(self) -> int:
        return len(self.engines)

    def _all(self, call: Callable[[RolloutEngine], Any], what: str) -> list[Any]:
        """`call` on every engine at once; the first failure (in engine order) is raised, naming it."""
        return self._results([self._pool.submit(call, e) for e in self.engines], what)

    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: SamplingParams
    ) -> list[list[Sample]]:
        check_prompts(prompt_token_ids, n)
        chunks = split_weighted(len(prompt_token_ids), self.weights)

        def run(k: int) -> list[list[Sample]]:
            start, stop = chunks[k]
            if start == stop:
                return []
            seeded = sampling if sampling.seed is None else dataclasses.replace(
                sampling, seed=sampling.seed + start * n)
            return self.engines[k].generate(prompt_token_ids[start:stop], n, seeded)

        futures = [self._pool.submit(run, k) for k in range(len(self.engines))]
        groups: list[list[Sample]] = []
        for k, fut in enumerate(futures):
            try:
                groups.extend(fut.result())
            except BaseException as e:
                for other, f in zip(self.engines, futures):  # stop the rest, then report this one
                    if not f.done():
                        with suppress(Exception):
                            other.abort()
                for f in futures:
                    with suppress(BaseException):
                        f.result()
                raise EngineGroupError(f"generate failed on rollout engine {self.names[k]}: {e}") from e
        return groups

    def stream(self) -> RolloutStream:
        """Every engine's stream behind one; groups go to the least loaded engine (group_stream.py)."""
        streams: list[RolloutStream] = []
        try:
            for engine in self.engines:
                streams.append(engine.stream())
        except BaseException:
            for s in streams:
                s.close()
            raise
        return GroupStream(streams, self.names, self.weights)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        queues: list[queue.Queue] = [queue.Queue(maxsize=_QUEUE_DEPTH) for _ in self.engines]
        stop = threading.Event()

        def drain(q: queue.Queue) -> Iterator[tuple[str, torch.Tensor]]:
            while (item := q.get()) is not _END:
                yield item

        def consume(k: int) -> None:
            try:
                self.engines[k].update_weights(drain(queues[k]))
            except BaseException:
                stop.set()
                raise

        futures = [self._pool.submit(consume, k) for k in range(len(self.engines))]
        try:
            for item in named_tensors:
                for q, fut in zip(queues, futures):
                    _put(q, item, fut)
                if stop.is_set():
                    break
        finally:
            for q, fut in zip(queues, futures):
                _put(q, _END, fut)
        self._results(futures, "update_weights")

    def _results(self, futures: list, what: str) -> list[Any]:
        """The futures' results in engine order, once all are done; the first failure is raised, naming it."""
        results: list[Any] = []
        failure: tuple[str, BaseException] | None = None
        for name, fut in zip(self.names, futures):
            try:
                results.append(fut.result())
            except BaseException as e:  # noqa: BLE001 - re-raised below with the engine named
                failure = failure or (name, e)
                results.append(None)
        if failure is not None:
            name, error = failure
            raise EngineGroupError(f"{what} failed on rollout engine {name}: {error}") from error
        return results

    def sleep(self, tags: Sequence[str] | None = None) -> None:
        self._all(lambda e: e.sleep() if tags is None else e.sleep(tags), "sleep")

    def wake(self, tags: Sequence[str] | None = None) -> None:
        self._all(lambda e: e.wake() if tags is None else e.wake(tags), "wake")

    def resident_bytes(self) -> dict[str, int]:
        """The first engine's: the one on the driver's devices, next to its actor shard."""
        return self.engines[0].resident_bytes()

    def score(self, token_ids: Sequence[int], start: int) -> list[list[float]]:
        return [lp for scored in self._all(lambda e: e.score(token_ids, start), "score") for lp in scored]

    def abort(self) -> None:
        self._all(lambda e: e.abort(), "abort")

    def health(self) -> bool:
        return all(self._all(lambda e: e.health(), "health"))

    def shutdown(self) -> None:
        try:
            self._all(lambda e: e.shutdown(), "shutdown")
        finally:
            self._pool.shutdown(wait=False)


def _put(q: queue.Queue, item: Any, consumer: Any) -> None:
    """Put `item` unless the queue's consumer has finished (it failed: nobody will read the queue)."""
    while not consumer.done():
        try:
            q.put(item, timeout=0.1)
            return
        except queue.Full:
            continue
