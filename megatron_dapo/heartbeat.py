"""The driver's heartbeat: the other ranks, waiting for the driver host-side (parallel.join_driver), notice a
driver that is alive but hung, not only a dead one.

The driver (global rank 0) runs a daemon thread that writes `<count> <phase>` into the rendezvous store every
few seconds; `phase` is what the driver last said it was doing (`set_phase`: "rollout of step 3"). A waiting
rank reads it while it waits; when the value has not changed for parallel.driver_heartbeat_timeout_s it stops
with one line naming that phase (DriverHungError). The beat comes from a thread, so it stops only when the
driver process stops running: stopped by a signal (SIGSTOP, a debugger), frozen (swapping, a dead file
system), or starved of the GIL by a call that never returns it. The store of a single-node job is served by
the driver's own process: a stopped driver stops answering, and every read then blocks, so the waiting rank
reads in a helper thread and measures the silence on its own clock (the hosts' clocks need not agree).

While it waits, a rank also serves the driver's requests (`ask`: a restarted rollout server takes the weights,
which every rank sends), in the order the driver makes them: a request is a store key the driver sets before it
runs the request's handler itself, so the collectives inside meet.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

KEY = "megatron_dapo/driver/heartbeat"

_phase = "start-up"
_beat: Beat | None = None
_requests = 0
"""Driver requests made (the driver) or served (every other rank) so far."""
_handler: Callable[[str], None] | None = None


class DriverHungError(RuntimeError):
    """The driver stopped beating while this rank waited for it."""


def set_phase(name: str) -> None:
    """What the driver does now (the heartbeat carries it; a waiting rank names it if the driver hangs)."""
    global _phase
    _phase = name


def interval_s(timeout_s: float) -> float:
    """How often the driver beats: ten beats per timeout, at most every 5 s."""
    return min(5.0, max(0.05, timeout_s / 10))


class Beat:
    """The driver's heartbeat thread: writes `<count> <phase>` to `store` every `every_s` seconds."""

    def __init__(self, store: Any, every_s: float):
        self.store, self.every_s, self.count = store, every_s, 0
        self._stop = threading.Event()
        self._write()
        self._thread = threading.Thread(target=self._run, name="driver-heartbeat", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        self.count += 1
        self.store.set(KEY, f"{self.count} {_phase}")

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self._write()
            except Exception:  # noqa: BLE001 - the store is gone: the run is ending, the waiters see it fail
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def start(store: Any, timeout_s: float) -> None:
    """On the driver, once the process group exists."""
    global _beat
    stop()
    _beat = Beat(store, interval_s(timeout_s))


def stop() -> None:
    global _beat, _phase, _requests, _handler
    if _beat is not None:
        _beat.stop()
    _beat, _phase, _requests, _handler = None, "start-up", 0, None


def on_request(handler: Callable[[str], None] | None) -> None:
    global _handler
    _handler = handler


def ask(store: Any, request: str) -> None:
    """The driver: every rank runs the handler on `request` (the others from await_driver; store None: alone)."""
    global _requests
    if store is not None:
        _requests += 1
        store.set(f"megatron_dapo/request/{_requests}", request)
    _serve(request)


def await_driver(store: Any, key: str, timeout_s: float, poll_s: float = 0.5) -> None:
    """Until the driver sets `key` (wait_for_key), serving its requests: one made before it set the key comes first."""
    global _requests
    while (request := f"megatron_dapo/request/{_requests + 1}") == wait_for_key(store, (request, key), timeout_s,
                                                                               poll_s):
        _requests += 1
        _serve(store.get(request).decode())


def _serve(request: str) -> None:
    if _handler is None:
        raise RuntimeError(f"the driver asked every rank for {request!r}, and nothing here serves it")
    _handler(request)


class _Watch:
    """A waiting rank's view of the store, kept up to date by a helper thread (whose reads may block)."""

    def __init__(self) -> None:
        self.beat, self.changed = "", time.monotonic()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.found = ""

    def poll(self, store: Any, keys: tuple[str, ...], poll_s: float) -> None:
        try:
            while (found := next((key for key in keys if store.check([key])), None)) is None:
                beat = store.get(KEY).decode() if store.check([KEY]) else ""
                if beat != self.beat:
                    self.beat, self.changed = beat, time.monotonic()
                time.sleep(poll_s)
            self.found = found
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread (a dead driver breaks the store)
            self.error = e
        self.done.set()

    def phase(self) -> str:
        return self.beat.partition(" ")[2] or "start-up (no heartbeat yet)"


def wait_for_key(store: Any, key: str | tuple[str, ...], timeout_s: float, poll_s: float = 0.5) -> str:
    """Wait until the driver sets `key` (or the first of several, in their order, is set; returned);
    DriverHungError if its heartbeat stays unchanged for `timeout_s`."""
    watch = _Watch()
    keys = (key,) if isinstance(key, str) else key
    threading.Thread(target=watch.poll, args=(store, keys, poll_s), name="driver-watch", daemon=True).start()
    last = time.monotonic()
    while not watch.done.wait(poll_s):
        now = time.monotonic()
        if now - last > max(10 * poll_s, 5.0):  # this rank was stopped itself (a suspended job): start afresh
            watch.changed = now
        last = now
        if now - watch.changed > timeout_s:
            raise DriverHungError(
                f"the driver (rank 0) has sent no heartbeat for {now - watch.changed:.0f} s "
                f"(parallel.driver_heartbeat_timeout_s={timeout_s:g}); its last phase: {watch.phase()}. It is "
                "alive but hung (stopped, frozen or starved): this rank stops; checkpoint.resume=auto continues "
                "from the last checkpoint")
    if watch.error is not None:
        raise watch.error
    return watch.found
