"""The child side of `ProcessEngine` (process_engine.py): an `EmbeddedEngine` in a process of its own, with
its own torch thread budget, serving the parent over two pipes.

- `cmd`: one request at a time from the parent, answered in order by this process's main thread
  (generate, the streams' submit / next / close, weight updates, sleep / wake, score, shutdown);
- `ctl`: aborts and shutdown, answered by a thread of their own, so they reach a generate or a stream's
  next() running in the main thread (as `abort()` / `shutdown()` from another thread do in process).

Every answer is ("ok", value, pending) or ("err", exception, traceback text, pending); `pending` is the
stream's pending count after the call (None outside a stream). An exception that does not survive
pickling travels as a RuntimeError naming its type. The child exits when the parent's end of a pipe
closes (the parent died), also in the middle of a generation.
"""

from __future__ import annotations

import copy
import os
import pickle
import threading
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch

ALIGN = 64
"""Byte alignment of each tensor in the weight buffer (any dtype's view is aligned)."""


def portable(e: BaseException) -> BaseException:
    """`e` if it pickles and rebuilds as itself (copy.copy rebuilds through the same __reduce__ the parent's
    unpickling calls), else a RuntimeError naming its type and message."""
    try:
        pickle.dumps(e)
        if type(copy.copy(e)) is type(e):
            return e
    except Exception:  # noqa: BLE001, S110 - any failure means: send a stand-in
        pass
    return RuntimeError(f"{type(e).__name__}: {e}")


def _error(e: BaseException, pending: int | None) -> tuple:
    return ("err", portable(e), "".join(traceback.format_exception(e)), pending)


class Worker:
    """The engine and its open streams, by id."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from megatron_dapo.rollout.embedded import EmbeddedEngine

        torch.set_num_threads(spec["threads"])
        self.engine = EmbeddedEngine(spec["model"], device=spec["device"], dtype=spec["dtype"],
                                     max_batch_tokens=spec["max_batch_tokens"], fast_path=spec["fast_path"],
                                     weights_backup=spec["weights_backup"])
        self.streams: dict[int, Any] = {}
        self.buffer: torch.Tensor | None = None
        self.stopping = False

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "threads": torch.get_num_threads()}

    def handle(self, op: str, args: tuple) -> tuple[Any, int | None]:
        """(value, pending) of one cmd request."""
        if op.startswith("stream_"):
            sid = args[0]
            stream = self.streams[sid]
            if op == "stream_submit":
                value = stream.submit(args[1])
            elif op == "stream_next":
                value = stream.next()
            elif op == "stream_close":
                self.streams.pop(sid).close()
                return None, 0
            else:
                raise ValueError(f"unknown stream request {op!r}")
            return value, stream.pending
        if op == "stream":
            self.streams[args[0]] = self.engine.stream()
            return None, 0
        if op == "weights":
            buffer, entries = args
            if buffer is not None:
                self.buffer = buffer
            self.engine.update_weights(self._views(entries))
            return None, None
        if op in ("generate", "sleep", "wake", "score", "health"):
            return getattr(self.engine, op)(*args), None
        raise ValueError(f"unknown engine request {op!r}")

    def _views(self, entries: list[tuple[str, torch.dtype, tuple[int, ...], int]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The bucket's tensors as views of the shared buffer (the engine copies them into its weights)."""
        for name, dtype, shape, offset in entries:
            numel = 1
            for d in shape:
                numel *= d
            nbytes = numel * torch.empty(0, dtype=dtype).element_size()
            yield name, self.buffer[offset:offset + nbytes].view(dtype).view(shape)

    def control(self, ctl: Connection) -> None:
        """The control thread: engine or stream aborts, and the resident bytes, while the main thread may be busy."""
        while True:
            try:
                op, args = ctl.recv()
            except (EOFError, OSError):
                os._exit(0 if self.stopping else 1)  # the parent is gone: stop even in the middle of a generation
            try:
                if op in ("abort", "shutdown"):
                    self.stopping = self.stopping or op == "shutdown"
                    getattr(self.engine, op)()
                    ctl.send(("ok", None, None))
                elif op == "resident_bytes":  # sizes of tensors: safe beside a running generation
                    ctl.send(("ok", self.engine.resident_bytes(), None))
                else:  # stream_abort
                    stream = self.streams.get(args[0])
                    report = stream.abort() if stream is not None else None
                    ctl.send(("ok", report, 0))
            except BaseException as e:  # noqa: BLE001 - re-raised in the parent
                ctl.send(_error(e, None))


def main(cmd: Connection, ctl: Connection, spec: dict[str, Any]) -> None:
    """The process's entry point: build the engine (its failure answers the start-up request), then serve."""
    try:
        worker = Worker(spec)
    except BaseException as e:  # noqa: BLE001 - re-raised in the parent
        cmd.send(_error(e, None))
        return
    cmd.send(("ok", worker.info(), None))
    threading.Thread(target=worker.control, args=(ctl,), name="engine-control", daemon=True).start()
    while True:
        try:
            op, args = cmd.recv()
        except (EOFError, OSError):
            os._exit(1)  # the parent is gone
        if op == "shutdown":
            worker.stopping = True
            worker.engine.shutdown()
            cmd.send(("ok", None, None))
            return
        pending = None
        try:
            value, pending = worker.handle(op, args)
            cmd.send(("ok", value, pending))
        except BaseException as e:  # noqa: BLE001 - re-raised in the parent
            if op.startswith("stream_") and args and args[0] in worker.streams:
                pending = worker.streams[args[0]].pending
            cmd.send(_error(e, pending))
