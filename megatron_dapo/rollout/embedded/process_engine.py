"""The embedded engine in a process of its own (`ProcessEngine`): what off-policy pipelining runs on the
embedded engine, so the engine's Python and kernels run beside the actor's instead of taking turns with
them for one interpreter lock, on a thread budget of its own (`threads`).

The child (process_worker.py, started with multiprocessing's spawn context) holds an `EmbeddedEngine`
built from the HF folder; this side keeps the `RolloutEngine` interface and is exactly as strict:
- the same requests give the same samples and logprobs as an in-process EmbeddedEngine with as many
  threads (the child runs the very same code);
- errors raised in the child (bad requests, NonFiniteLogitsError, GenerationAborted, KeyError /
  ValueError of a weight update, EngineStateError) are raised here with their type, the child's
  traceback attached as a note;
- weights travel through a shared-memory buffer that this side owns and fills bucket by bucket; the
  child copies each bucket into its own parameters before the next one is written, so the engine never
  aliases the actor's parameters;
- every wait polls with a timeout and checks the child: a dead child is an EngineProcessError naming its
  exit code, a child that does not answer within the limit one naming the call; the engine is then
  unusable (its process is reaped);
- with `restarts` (the run's budget, restarts.py), a child that dies or stops answering during a request is
  reaped and started again; it takes the weights of the last update (kept in this process for it), the
  sleep state, and every open stream's pending groups as they were submitted (same prompts, same seeds:
  nothing is trained twice or dropped); then the request runs again. Past the budget: EngineLostError;
- `shutdown()` (also on garbage collection and at interpreter exit) always reaps the child: asked to
  stop, then terminated, then killed. The child starts with the trainer's stop signals blocked
  (stop_signals.py): a SIGTERM to the job's process group leaves it serving while the trainer saves.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from megatron_dapo.rollout.base import (
    MEMORY_TAGS,
    AbortReport,
    EngineStateError,
    GenerationAborted,
    GroupRequest,
    GroupResult,
    RolloutEngine,
    RolloutStream,
    SamplingParams,
)
from megatron_dapo.rollout.embedded.process_worker import ALIGN, main
from megatron_dapo.rollout.restarts import EngineLostError, Restarts
from megatron_dapo.stop_signals import helpers_shielded
from megatron_dapo.types import Sample

_RESTARTABLE = ("generate", "score", "stream", "stream_submit", "stream_next", "sleep", "wake")
CONTROL_TIMEOUT_S = 120.0
"""Limit on an answer that needs no generation (abort, submit, a weight bucket, sleep / wake, close)."""


class EngineProcessError(EngineStateError):
    """The engine's process died or did not answer in time; the engine is unusable."""


class ProcessEngine(RolloutEngine):
    """An EmbeddedEngine over `model` (an HF folder) in a child process with `threads` torch threads.

    `startup_timeout_s` bounds building the engine, `request_timeout_s` one generate, one stream next() or
    one score; the other calls are bounded by CONTROL_TIMEOUT_S. `bucket_mb`: the weight buffer (a tensor
    larger than it gets a buffer of its own size). `restarts`: restart a lost child (the module docstring)."""

    def __init__(self, model: str | Path, *, threads: int = 1, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, max_batch_tokens: int = 1 << 17,
                 fast_path: bool | None = None, weights_backup: bool = False, startup_timeout_s: float = 600.0,
                 request_timeout_s: float = 3600.0, bucket_mb: int = 64, restarts: Restarts | None = None) -> None:
        if threads < 1:
            raise ValueError(f"threads={threads} must be >= 1")
        self.threads, self.request_timeout_s = threads, request_timeout_s
        self._bucket = bucket_mb << 20
        self._buffer: torch.Tensor | None = None
        self._closed = False
        self._cmd_lock, self._ctl_lock = threading.Lock(), threading.Lock()
        self._next_stream = 0
        self.restarts = restarts
        self._kept: dict[str, torch.Tensor] | None = {} if restarts is not None else None  # the last update's
        self._released: list[str] | None = []  # what the child has released (None: everything)
        self._streams: weakref.WeakValueDictionary[int, ProcessStream] = weakref.WeakValueDictionary()
        self._spec = {"model": str(model), "threads": threads, "device": str(device), "dtype": dtype,
                      "max_batch_tokens": max_batch_tokens, "fast_path": fast_path, "weights_backup": weights_backup}
        self._startup_timeout_s = startup_timeout_s
        self._spawn()

    def _spawn(self) -> None:
        """Start the child and wait for its engine (a failure shuts this engine down)."""
        self._buffer_sent = False
        self._broken: str | None = None
        ctx = mp.get_context("spawn")
        self._cmd, child_cmd = ctx.Pipe()
        self._ctl, child_ctl = ctx.Pipe()
        self._proc = ctx.Process(target=main, args=(child_cmd, child_ctl, self._spec), name="rollout-engine",
                                 daemon=True)
        with _main_not_reimported(), helpers_shielded():  # the trainer's stop signals are not the engine's
            self._proc.start()
        child_cmd.close(), child_ctl.close()
        self.pid = self._proc.pid
        self._reaper = weakref.finalize(self, _reap, self._proc, self._cmd, self._ctl)
        try:
            with self._cmd_lock:
                self.info: dict[str, Any] = self._wait(self._cmd, "start-up", self._startup_timeout_s)[0]
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------------------------ requests

    def _call(self, op: str, *args: Any, timeout: float = CONTROL_TIMEOUT_S) -> tuple[Any, int | None]:
        try:
            return self._call_once(op, *args, timeout=timeout)
        except EngineProcessError as e:
            if self.restarts is None or self._closed or op not in _RESTARTABLE:
                raise
            self._restart(str(e))
            if op == "stream_submit":  # its groups were resubmitted with the stream's pending ones
                return None, self._streams[args[0]].pending
            return self._call_once(op, *args, timeout=timeout)

    def _restart(self, why: str) -> None:
        """The child is lost (already reaped): one restart from the budget, a new child, the state replayed."""
        self.restarts.take(f"process engine (pid {self.pid})", why)
        try:
            self._spawn()
        except Exception as e:
            raise EngineLostError(f"the rollout engine's process did not start again after a restart: {e}; "
                                  "stopped without saving") from e
        if self._kept:
            self._push(self._kept.items(), keep=False)
        if self._released is None or self._released:
            self._call_once("sleep", self._released)
        moved = 0
        for sid, stream in sorted(self._streams.items()):
            self._call_once("stream", sid)
            if stream.requests:
                self._call_once("stream_submit", sid, list(stream.requests.values()))
                moved += len(stream.requests)
        self.restarts.resubmitted(moved)

    def _call_once(self, op: str, *args: Any, timeout: float = CONTROL_TIMEOUT_S) -> tuple[Any, int | None]:
        with self._cmd_lock:
            self._check_usable()
            self._send(self._cmd, (op, args), op)
            return self._wait(self._cmd, op, timeout)

    def _control(self, op: str, *args: Any) -> tuple[Any, int | None]:
        with self._ctl_lock:
            self._check_usable()
            self._send(self._ctl, (op, args), op)
            return self._wait(self._ctl, op, CONTROL_TIMEOUT_S)

    def _send(self, conn: Connection, message: tuple, what: str) -> None:
        try:
            conn.send(message)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            self._fail(f"the engine process (pid {self.pid}) is gone: {what} could not be sent"
                       f"{self._exit_note()}")

    def _wait(self, conn: Connection, what: str, timeout: float) -> tuple[Any, int | None]:
        """The child's answer to `what`, its error raised here; a dead or silent child is an EngineProcessError."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if conn.poll(min(0.5, max(deadline - time.monotonic(), 0.0))):
                    answer = conn.recv()
                    break
            except (EOFError, OSError):
                self._fail(f"the engine process (pid {self.pid}) died during {what}{self._exit_note()}")
            if not self._proc.is_alive():
                self._fail(f"the engine process (pid {self.pid}) died during {what}{self._exit_note()}")
            if time.monotonic() >= deadline:
                self._fail(f"the engine process (pid {self.pid}) did not answer {what} within {timeout:g} s")
        if answer[0] == "ok":
            return answer[1], answer[2]
        _, error, trace, pending = answer
        error.add_note(f"raised in the engine process (pid {self.pid}):\n{trace.rstrip()}")
        error.pending = pending  # the stream's count after the failed call
        raise error

    def _fail(self, message: str) -> None:
        """The engine is unusable: its process is reaped, this and every later call raise `message`."""
        self._broken = message
        self._reaper()
        raise EngineProcessError(message)

    def _exit_note(self) -> str:
        self._proc.join(timeout=1.0)
        code = self._proc.exitcode
        return "" if code is None else f" (exit code {code})"

    def _check_usable(self) -> None:
        if self._closed:
            raise EngineStateError("ProcessEngine was shut down")
        if self._broken:
            raise EngineProcessError(self._broken)

    # ------------------------------------------------------------------------------- the interface

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], n: int,
                 sampling: SamplingParams) -> list[list[Sample]]:
        prompts = [list(p) for p in prompt_token_ids]
        return self._call("generate", prompts, n, sampling, timeout=self.request_timeout_s)[0]

    def stream(self) -> RolloutStream:
        with self._cmd_lock:
            sid = self._next_stream
            self._next_stream += 1
        self._call("stream", sid)
        stream = ProcessStream(self, sid)
        self._streams[sid] = stream
        return stream

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Bucket by bucket through the shared buffer: each bucket is copied into the child's weights (and
        checked there, name and shape, as the in-process engine checks them) before the next is written."""
        self._push(named_tensors, keep=self._kept is not None)

    def _push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], keep: bool) -> None:
        """update_weights; `keep`: also keep a copy of each tensor for a restarted child."""
        with self._cmd_lock:
            self._check_usable()
            entries: list[tuple[str, torch.dtype, tuple[int, ...], int]] = []
            used = 0
            for name, tensor in named_tensors:
                nbytes = tensor.numel() * tensor.element_size()
                if entries and used + nbytes > self._buffer.numel():
                    self._send_bucket(entries)
                    entries, used = [], 0
                if self._buffer is None or nbytes > self._buffer.numel():
                    self._buffer = torch.empty(max(nbytes, self._bucket), dtype=torch.uint8).share_memory_()
                    self._buffer_sent = False
                view = self._buffer[used:used + nbytes].view(tensor.dtype).view(tensor.shape)
                view.copy_(tensor.detach())
                if keep:
                    self._kept[name] = tensor.detach().clone()
                entries.append((name, tensor.dtype, tuple(tensor.shape), used))
                used = -(-(used + nbytes) // ALIGN) * ALIGN
            if entries:
                self._send_bucket(entries)

    def _send_bucket(self, entries: list) -> None:
        buffer = None if self._buffer_sent else self._buffer
        self._send(self._cmd, ("weights", (buffer, entries)), "update_weights")
        self._buffer_sent = True
        self._wait(self._cmd, "update_weights", CONTROL_TIMEOUT_S)

    def sleep(self, tags: Sequence[str] | None = None) -> None:
        self._call("sleep", None if tags is None else list(tags))
        if self._released is not None:
            self._released = None if tags is None else sorted({*self._released, *tags})

    def wake(self, tags: Sequence[str] | None = None) -> None:
        self._call("wake", None if tags is None else list(tags))
        if tags is None:
            self._released = []
        else:
            self._released = [t for t in (MEMORY_TAGS if self._released is None else self._released) if t not in tags]

    def resident_bytes(self) -> dict[str, int]:
        """On the control channel: the phases' ledger asks while a generation holds the request channel (the
        actor's train phase begins while the engine generates the next batch), and must not wait for it."""
        if self._closed or self._broken:
            return {"weights": 0, "kv_cache": 0}
        return self._control("resident_bytes")[0]

    def score(self, token_ids: Sequence[int], start: int) -> list[list[float]]:
        return self._call("score", list(token_ids), start, timeout=self.request_timeout_s)[0]

    def abort(self) -> None:
        """A running generate (another thread's) raises GenerationAborted; else a no-op."""
        if not self._closed and not self._broken:
            self._control("abort")

    def health(self) -> bool:
        return not self._closed and not self._broken and self._proc.is_alive()

    def shutdown(self) -> None:
        """Idempotent; the child is reaped whatever happens (asked, then terminated, then killed)."""
        if self._closed:
            return
        self._closed = True
        try:
            if not self._broken and self._proc.is_alive():
                with self._ctl_lock:  # the engine closes now: a generation or stream step running for another
                    self._ctl.send(("shutdown", ()))  # thread stops, as in process (EngineStateError there)
                    if self._ctl.poll(30.0):
                        self._ctl.recv()
                if self._cmd_lock.acquire(timeout=30.0):
                    try:
                        self._cmd.send(("shutdown", ()))
                        self._cmd.poll(30.0)
                    finally:
                        self._cmd_lock.release()
        except (OSError, EOFError):
            pass
        finally:
            self._reaper()
            self._buffer = None


class ProcessStream(RolloutStream):
    """A stream of the child's engine: submit / next / close through the request pipe, abort through the
    control pipe (so it reaches a next() running in another thread, which raises GenerationAborted)."""

    def __init__(self, engine: ProcessEngine, sid: int) -> None:
        self._engine, self._sid, self._pending, self._closed = engine, sid, 0, False
        self.requests: dict[int, GroupRequest] = {}
        """The groups submitted and not yet returned or cancelled (resubmitted to a restarted child)."""

    @property
    def pending(self) -> int:
        return self._pending

    def _call(self, op: str, *args: Any, timeout: float = CONTROL_TIMEOUT_S) -> Any:
        if self._closed:
            raise EngineStateError("the stream was closed")
        try:
            value, pending = self._engine._call(op, self._sid, *args, timeout=timeout)
        except Exception as e:  # an abort from another thread sets the count itself
            if getattr(e, "pending", None) is not None and not isinstance(e, GenerationAborted):
                self._pending = getattr(e, "pending")
            raise
        self._pending = pending
        return value

    def submit(self, requests: Sequence[GroupRequest]) -> None:
        self.requests.update((r.key, r) for r in requests)
        try:
            self._call("stream_submit", list(requests))
        except Exception:
            for r in requests:
                self.requests.pop(r.key, None)
            raise

    def next(self) -> GroupResult:
        result = self._call("stream_next", timeout=self._engine.request_timeout_s)
        self.requests.pop(result.key, None)
        return result

    def abort(self) -> AbortReport:
        report, _ = self._engine._control("stream_abort", self._sid)
        self._pending = 0
        self.requests.clear()
        return report if report is not None else AbortReport(keys=[], tokens=0)

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._engine.health():
                self._call("stream_close")  # aborts what is pending, as the in-process stream's close
        finally:
            self._closed, self._pending = True, 0
            self.requests.clear()


@contextmanager
def _main_not_reimported() -> Iterator[None]:
    """Spawn re-imports the parent's __main__ in the child (its `-m` module or script) unless it has neither
    a module name nor a file: the child needs none of it (its entry point is process_worker.main), and a
    script without an `if __name__ == "__main__"` guard would start again there."""
    main = sys.modules["__main__"]
    saved = {k: getattr(main, k) for k in ("__spec__", "__file__") if hasattr(main, k)}
    main.__spec__ = None
    if "__file__" in saved:
        del main.__file__
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)


def _reap(proc: Any, *conns: Connection) -> None:
    """Stop the child for good (it was asked to, or is gone, or does not answer): the pipes close first (a child
    that still serves exits at once when it sees them closed), then it is terminated, then killed."""
    for conn in conns:
        conn.close()
    proc.join(timeout=10.0)
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=5.0)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=5.0)
