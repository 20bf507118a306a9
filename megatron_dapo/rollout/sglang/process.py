"""Process-tree handling for a launched server (Linux): the parent-death signal, a port probe, the
worker processes (with start times against PID reuse), the kill of a whole process group, a log tail.
Nothing here knows SGLang; `server.SGLangServer` uses it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from contextlib import suppress
from pathlib import Path
from typing import Any


def parent_death_signal_setter() -> Any:
    """A preexec_fn asking the kernel to SIGTERM the server when the launching thread dies (Linux).

    libc is loaded here, in the parent: the function that runs between fork and exec imports nothing.
    """
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def set_pdeathsig() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    return set_pdeathsig


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) == 0


def child_processes(pid: int) -> list[tuple[int, float]]:
    """(pid, start time) of the process's descendants; the start time guards against PID reuse."""
    try:
        import psutil

        return [(c.pid, c.create_time()) for c in psutil.Process(pid).children(recursive=True)]
    except Exception:
        return []


def same_process(pid: int, started: float) -> bool:
    """Whether `pid` is still the (living) process that started at `started`."""
    try:
        import psutil

        p = psutil.Process(pid)
        return abs(p.create_time() - started) < 1e-3 and p.status() != psutil.STATUS_ZOMBIE
    except Exception:
        return False


def kill_process_group(proc: subprocess.Popen, children: list[tuple[int, float]], grace_s: float) -> None:
    """SIGTERM `proc`'s process group, SIGKILL it after `grace_s`; also SIGKILL the `children` (from
    `child_processes`) still alive, which may have left the group or outlived the parent. By PID,
    never by name."""
    if proc.poll() is None:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    for pid, started in children:
        if same_process(pid, started):
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def file_tail(path: Path, lines: int) -> str:
    """The last `lines` lines of a (log) file, reading at most its last 64 KiB."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError as e:
        return f"(cannot read the log: {e})"
    return "\n".join(text.splitlines()[-lines:])
