"""Off-policy pipelining (`rollout.async_steps=1`): the engine generates the next step's batch while the
actor trains, on the driver rank.

The schedule is fixed, so a run is reproducible and a killed run resumes exactly: while step s trains,
batch s+1 is generated from the weights after step s-1 (the engine's weights then); the main thread waits
for it at the batch boundary, then the weights after step s reach the engine (the step's sync). Batch 1
and the first batch after a resume come from the weights the engine holds then. A checkpoint at step s
holds batch s+1, generated and not yet trained on (`state_dict`), so the resumed run trains on the very
same batch. Samples are stamped with the policy version that generated them (`Sample.versions`); a group
with a sample older than `async_steps` versions when it is trained on (a partial rollout's carried group)
is dropped and counted.

The producer is one background thread. The engine has its own weights (never the actor's, which change
under it) and its own cores: the embedded engine runs in a process of its own with its share of the torch
threads (loop/engines.py; a thread would take turns with the actor for the interpreter lock), so the
producer thread only drives it and scores; with SGLang the producer thread takes half of the process's
torch threads (`engine_threads`) and the actor keeps the rest.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from megatron_dapo.rollout.step.result import StepRollout, load_rollout, rollout_state


def engine_threads(total: int | None = None) -> int:
    """The engine's share of the process's torch threads (`total`, default all): half, at least one."""
    return max(1, (total or torch.get_num_threads()) // 2)


class RolloutPipeline:
    """Produces step batches in a background thread (`start`), hands them over at the boundary (`take`),
    and measures how the two sides overlapped within each step (`step_scalars`)."""

    def __init__(self, threads: int | None = None) -> None:
        """`threads`: the producer thread's torch threads; None = half of this process's, the actor (this
        thread) keeping the rest."""
        self.produce: Callable[[int], StepRollout] | None = None
        """step -> that step's rollout on the engine's current weights (set by the training loop)."""
        if threads is None:
            total = torch.get_num_threads()
            threads = engine_threads(total)
            torch.set_num_threads(max(1, total - threads))  # the actor's share (this thread)
        self.threads = threads
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-producer")
        self._pending: tuple[int, Future] | None = None
        self._ready: tuple[int, StepRollout] | None = None
        self._busy: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._waited = 0.0
        self._t0: float | None = None
        """Start of the step being measured: the first take, then the end of the last step_scalars."""

    def start(self, step: int) -> None:
        """Begin producing batch `step` in the background from the engine's weights as they are now."""
        assert self._pending is None and self._ready is None, "one batch ahead at most"
        self._pending = (step, self._pool.submit(self._run, step))

    def _run(self, step: int) -> StepRollout:
        torch.set_num_threads(self.threads)  # the producer thread's share
        return self._timed(step)

    def _timed(self, step: int) -> StepRollout:
        """produce(step), its interval recorded as the engine's busy time."""
        t0 = time.perf_counter()
        try:
            return self.produce(step)
        finally:
            with self._lock:
                self._busy.append((t0, time.perf_counter()))

    def wait(self) -> None:
        """The batch boundary: block until the batch in production is done (its error raised here)."""
        if self._pending is None:
            return
        step, future = self._pending
        self._pending = None
        t0 = time.perf_counter()
        try:
            self._ready = (step, future.result())
        finally:
            self._waited += time.perf_counter() - t0

    def take(self, step: int) -> StepRollout:
        """Batch `step`: the one produced ahead (waited for), else produced now, in this thread."""
        if self._t0 is None:
            self._t0 = time.perf_counter()
        self.wait()
        if self._ready is not None:
            ready, rollout = self._ready
            self._ready = None
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
        (nothing was being generated), timing/overlap_s (both were busy)."""
        now = time.perf_counter()
        if self._t0 is None:
            self._t0 = now
        with self._lock:
            busy = sum(min(b, now) - max(a, self._t0) for a, b in self._busy if b > self._t0 and a < now)
            self._busy = [(a, b) for a, b in self._busy if b > now]
        running = self._pending is not None and not self._pending[1].done()
        wall, waited = now - self._t0, self._waited
        self._t0, self._waited = now, 0.0
        return {"timing/actor_idle_s": waited, "timing/engine_idle_s": max(wall - busy, 0.0) if not running
                else 0.0, "timing/overlap_s": max(busy - waited, 0.0)}

    # --- checkpoints ------------------------------------------------------------------------------------

    def state_dict(self) -> dict | None:
        """The batch produced and not yet trained on (call at the boundary), as plain JSON."""
        assert self._pending is None, "save at the batch boundary"
        if self._ready is None:
            return None
        step, rollout = self._ready
        return {"step": step, "rollout": rollout_state(rollout)}

    def load_state_dict(self, state: dict | None) -> None:
        self._ready = None if not state else (int(state["step"]), load_rollout(state["rollout"]))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
