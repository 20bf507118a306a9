"""Off-policy pipelining (`rollout.async_steps=k`): the engine generates the next steps' batches while the
actor trains, on the driver rank.

The schedule is fixed, so a run is reproducible and a killed run resumes exactly: batch b is generated from
the weights after step b-1-k (or the weights the engine holds when the run starts or resumes, if later
than that), so a batch is trained on k policy versions after the weights that made it, and the engine runs
at most k batches ahead of the actor. With k=1, while step s trains, batch s+1 is generated from the weights
after step s-1; the main thread waits for it at the batch boundary, then the weights after step s reach the
engine directly (the step's sync). With k >= 2 the engine may still be generating an older batch when a step
ends, so the step's weights are copied to host memory instead (`publish`, a WeightSnapshot) and the producer
hands them to the engine before the batch that needs them; it holds up to k snapshots when generation lags.
Fully async (`rollout.async_mode=stream`, `stream=True`): every step's weights are published as a snapshot,
and the producer hands the newest to the engine before a batch and again mid-batch: `publish` aborts the
group stream if it is waiting for a group (`waiting`; the engine stops at its next decode step), and the
stream resumes its groups on the new weights (`interruption`, `fresher`, `refresh`; collect/streaming.py),
so batch b's tokens are from the weights after step b-1-k or newer: still at most k versions old.
A checkpoint at step s holds batches s+1 .. s+k, generated and not yet trained on (`state_dict` waits for
them), so the resumed run trains on the very same batches and generates batch s+k+1 from the checkpoint's
weights, as the uninterrupted run does. Samples are stamped with the policy version that generated them
(`Sample.versions`); a group with a sample older than k versions when it is trained on (a partial
rollout's carried group) is dropped and counted.

The producer is one background thread. The engine has its own weights (never the actor's, which change
under it) and its own cores: the embedded engine runs in a process of its own with its share of the torch
threads (loop/engines.py; a thread would take turns with the actor for the interpreter lock), so the
producer thread only drives it and scores; with SGLang the producer thread takes half of the process's
torch threads (`engine_threads`) and the actor keeps the rest.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from megatron_dapo.rollout.base import AbortReport, RolloutStream
from megatron_dapo.collect.result import StepRollout, load_rollout, rollout_state


def engine_threads(total: int | None = None) -> int:
    """The engine's share of the process's torch threads (`total`, default all): half, at least one."""
    return max(1, (total or torch.get_num_threads()) // 2)


@dataclass
class WeightSnapshot:
    """The actor's weights after one step, as HF-named host tensors (a weight-sync target: update_weights
    keeps a copy of each tensor); `expected`: the weight-sync probe's actor logprobs, if probed."""

    version: int
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    expected: torch.Tensor | None = None

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.tensors.extend((name, t.detach().to("cpu", copy=True)) for name, t in named_tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)


class RolloutPipeline:
    """Produces step batches in a background thread (`start`), hands them over at the boundary (`take`),
    hands the engine the weights each batch is due (`publish`, `apply_weights`), and measures how the two
    sides overlapped within each step (`step_scalars`)."""

    def __init__(self, threads: int | None = None, depth: int = 1, version: int = 0, stream: bool = False, *,
                 produce: Callable[[int], StepRollout] | None = None,
                 apply_weights: Callable[[WeightSnapshot], None] | None = None) -> None:
        """`threads`: the producer thread's torch threads; None = half of this process's, the actor (this
        thread) keeping the rest. `depth`: rollout.async_steps. `version`: the engine's weights (the step
        they are from) when the run starts. `stream`: rollout.async_mode=stream (module docstring).
        `produce`: step -> that step's rollout on the engine's current weights (`version`); `apply_weights`:
        the engine takes a snapshot's weights (depth >= 2); both run on the producer thread."""
        if depth < 1:
            raise ValueError(f"depth={depth}: the pipeline runs at least one batch ahead")
        self.produce, self.apply_weights = produce, apply_weights
        if threads is None:
            total = torch.get_num_threads()
            threads = engine_threads(total)
            torch.set_num_threads(max(1, total - threads))  # the actor's share (this thread)
        self.threads, self.depth, self.version, self.stream = threads, depth, version, stream
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-producer")
        self._pending: deque[tuple[int, Future]] = deque()
        self._ready: deque[tuple[int, StepRollout]] = deque()
        self._snapshots: dict[int, WeightSnapshot] = {}
        self._busy: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._live_lock = threading.Lock()
        self._live: RolloutStream | None = None
        self._interrupt: AbortReport | None = None
        self._waited = 0.0
        self._t0: float | None = None
        """Start of the step being measured: the first take, then the end of the last step_scalars."""

    @property
    def last_queued(self) -> int | None:
        """The last batch started or ready, None if none."""
        queued = [*self._ready, *self._pending]
        return queued[-1][0] if queued else None

    def due_version(self, step: int) -> int:
        """The weights batch `step` is generated from: those after step - 1 - depth (or the engine's, if later)."""
        return max(step - 1 - self.depth, self.version)

    def start(self, step: int) -> None:
        """Begin producing batch `step` in the background, once the batches before it are done."""
        if len(self._pending) + len(self._ready) >= self.depth:
            raise RuntimeError(f"batch {step}: the pipeline already holds {self.depth} batch(es) ahead")
        self._pending.append((step, self._pool.submit(self._run, step)))

    def fill(self, step: int, last: int) -> None:
        """After taking batch `step`: start every batch up to step + depth (at most `last`) not yet queued."""
        first = (self.last_queued or step) + 1
        for b in range(first, min(step + self.depth, last) + 1):
            self.start(b)

    def publish(self, step: int, snapshot: WeightSnapshot | None) -> None:
        """The weights after `step`, published at every step's end: a snapshot for the producer to hand over
        before the batch that is due them (depth >= 2), or None: nothing new to hand over (depth 1: synced
        at the boundary, with nothing in production; or the step made no update; or no batch is due them)."""
        if self.depth == 1 and not self.stream:
            assert snapshot is None and not self._pending, "depth 1 syncs at the boundary, nothing in production"
            self.version = step
            return
        with self._live_lock:  # fully async: a stream waiting for a group stops for these weights
            with self._lock:
                self._snapshots[step] = snapshot
            if self.stream and snapshot is not None and self._live is not None and self._interrupt is None:
                self._interrupt, self._live = self._live.abort(), None

    @contextmanager
    def waiting(self, stream: RolloutStream) -> Iterator[None]:
        """The producer waits for `stream`'s next group: `publish` may abort the stream meanwhile."""
        with self._live_lock:
            self._live = stream
        try:
            yield
        finally:
            with self._live_lock:
                self._live = None

    def interruption(self) -> AbortReport | None:
        """The report of the abort by which `publish` ended the producer's stream (taken once), if any."""
        with self._live_lock:
            report, self._interrupt = self._interrupt, None
        return report

    def synced(self, step: int) -> None:
        """The engine took the weights after `step` directly (nothing in production; before an evaluation):
        the snapshots up to them are not needed any more."""
        assert not self._pending, "the engine's weights change only with nothing in production"
        with self._lock:
            for v in [v for v in self._snapshots if v <= step]:
                del self._snapshots[v]
        self.version = step

    def _run(self, step: int) -> StepRollout:
        torch.set_num_threads(self.threads)  # the producer thread's share
        return self._timed(step)

    def fresher(self) -> bool:
        """Fully async: weights newer than the engine's were published (the producer may `refresh`)."""
        with self._lock:
            return self.stream and any(v > self.version and snap is not None for v, snap in self._snapshots.items())

    def refresh(self) -> None:
        """Fully async, the producer mid-batch (nothing in flight on the engine): it takes the newest weights."""
        with self._lock:
            newest = max(self._snapshots, default=self.version)
        self._take_weights(newest)

    def _take_weights(self, due: int) -> None:
        """The producer: the engine takes the newest weights up to those after step `due` (fully async: or
        newer, as published); older snapshots go."""
        if self.stream:
            with self._lock:
                due = max(due, *self._snapshots) if self._snapshots else due
        if due <= self.version:
            return
        with self._lock:
            missing = [v for v in range(self.version + 1, due + 1) if v not in self._snapshots]
            newest = next((self._snapshots[v] for v in range(due, self.version, -1) if self._snapshots.get(v)), None)
            for v in [v for v in self._snapshots if v <= due]:
                del self._snapshots[v]
        if missing:
            raise RuntimeError(f"the engine is due the weights after step {due}, but those after step(s) "
                               f"{missing} were never published")
        if newest is not None:
            self.apply_weights(newest)
        self.version = due

    def _timed(self, step: int) -> StepRollout:
        """produce(step) with the weights it is due, its interval recorded as the engine's busy time."""
        t0 = time.perf_counter()
        try:
            self._take_weights(self.due_version(step))
            return self.produce(step)
        finally:
            with self._lock:
                self._busy.append((t0, time.perf_counter()))

    def wait(self) -> None:
        """The batch boundary: block until the oldest batch in production is done (its error raised here)."""
        if not self._pending:
            return
        step, future = self._pending.popleft()
        t0 = time.perf_counter()
        try:
            self._ready.append((step, future.result()))
        finally:
            self._waited += time.perf_counter() - t0

    def drain(self) -> None:
        """Wait for every batch in production."""
        while self._pending:
            self.wait()

    def take(self, step: int) -> StepRollout:
        """Batch `step`: the one produced ahead (waited for), else produced now, in this thread."""
        if self._t0 is None:
            self._t0 = time.perf_counter()
        if not self._ready:
            self.wait()
        if self._ready:
            ready, rollout = self._ready.popleft()
            if ready != step:
                raise RuntimeError(f"the pipeline holds batch {ready}, step {step} asked for its own")
            return rollout
        t0 = time.perf_counter()
        try:
            return self._timed(step)
        finally:
            self._waited += time.perf_counter() - t0

    def step_scalars(self) -> dict[str, float]:
        """Since the last call: timing/actor_idle_s (the actor waited for the engine), timing/engine_idle_s
        (nothing was being generated), timing/overlap_s (both were busy); depth >= 2: the host memory of the
        snapshots held now (memory/weight_snapshot_bytes)."""
        now = time.perf_counter()
        if self._t0 is None:
            self._t0 = now
        with self._lock:
            busy = sum(min(b, now) - max(a, self._t0) for a, b in self._busy if b > self._t0 and a < now)
            self._busy = [(a, b) for a, b in self._busy if b > now]
            held = sum(snap.nbytes for snap in self._snapshots.values() if snap is not None)
        running = any(not f.done() for _, f in self._pending)
        wall, waited = now - self._t0, self._waited
        self._t0, self._waited = now, 0.0
        out = {"timing/actor_idle_s": waited, "timing/engine_idle_s": max(wall - busy, 0.0) if not running
               else 0.0, "timing/overlap_s": max(busy - waited, 0.0)}
        return {**out, "memory/weight_snapshot_bytes": float(held)} if self.depth >= 2 else out

    # --- checkpoints ------------------------------------------------------------------------------------

    def state_dict(self) -> dict | None:
        """The batches produced and not yet trained on (waited for: call at the batch boundary), as plain
        JSON: {"step", "rollout"} of the first, and "more" of the rest (depth >= 2)."""
        self.drain()
        if not self._ready:
            return None
        (step, rollout), *more = self._ready
        return {"step": step, "rollout": rollout_state(rollout),
                "more": [{"step": s, "rollout": rollout_state(r)} for s, r in more]}

    def load_state_dict(self, state: dict | None, version: int = 0) -> None:
        """The saved batches; `version`: the step the engine's weights are from (the checkpoint's)."""
        self._ready = deque((int(b["step"]), load_rollout(b["rollout"])) for b in
                            ([state, *state.get("more", [])] if state else []))
        self.version = version

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
