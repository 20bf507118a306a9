"""Process-tree handling for a launched server (Linux): its start (own session, stop signals blocked, the
parent-death signal, a watchdog, every CPU of the node's allocation), a port probe, the worker processes (with start times against PID reuse),
the kill of a whole process group, a log tail. Nothing here knows SGLang; `server.SGLangServer` uses it."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path
from typing import Any

from megatron_dapo.stop_signals import block_stop_signals


# The server's process, in its own session (pgid = its pid), execs the server after leaving a watchdog in
# the group: the watchdog reads its stdin, a pipe the trainer holds, until the trainer is gone (EOF), then
# waits $0 seconds and SIGKILLs the whole group (itself included; a group outlives its leader, so the pgid is
# never another's). Double-forked, so the server's own cleanup (SGLang kills its child processes) spares it.
_WATCHDOG = 'exec 3<&0 </dev/null; ( (read -r _ <&3; sleep "$0"; kill -9 0) & ); exec 3<&-; exec "$@"'
# `python -m MODULE ...` for a server, run through this: multiprocessing's resource tracker, started by the
# server's first child process, unblocks SIGTERM in the thread that starts it (CPython 3.11); started first
# and the block taken again, SIGTERM stays blocked in the server and in every process it spawns.
_BLOCKED_MAIN = ("import runpy, signal, sys; from multiprocessing import resource_tracker; "
                 "resource_tracker.ensure_running(); "
                 "signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGUSR1)); "
                 "sys.argv.pop(0); runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")
STOP_SIGNAL = signal.SIGINT
"""How a server is asked to stop (graceful in SGLang and uvicorn); SIGTERM and SIGUSR1 are blocked in it."""
WATCHDOG_GRACE_S = 5.0
"""At most this long after its trainer is gone, a server's process group is SIGKILLed."""


def start_server_process(cmd: Sequence[str], *, stdout: Any, env: dict[str, str], kill_with_parent: bool,
                         grace_s: float) -> tuple[subprocess.Popen, int | None]:
    """Start `cmd` in a new session with the trainer's stop signals blocked (stop_signals.py: Slurm's SIGTERM to
    every process of the job must leave the server serving until the trainer has saved). With
    `kill_with_parent`, the kernel sends it STOP_SIGNAL when the launching thread dies (PR_SET_PDEATHSIG),
    and a watchdog SIGKILLs its process group min(`grace_s`, WATCHDOG_GRACE_S) after the trainer is gone, when
    a hung server (in start-up, say) ignores that. Returns the process and the watchdog pipe's write end, which the caller
    keeps open while it owns the server (None without `kill_with_parent`)."""
    cmd = list(cmd)
    if cmd[1:2] == ["-m"]:
        cmd[1:2] = ["-c", _BLOCKED_MAIN]
    preexec = _server_preexec(kill_with_parent)
    common = dict(stdout=stdout, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=preexec)
    if not kill_with_parent:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, **common), None
    read, write = os.pipe()
    try:
        grace = f"{min(grace_s, WATCHDOG_GRACE_S):g}"
        proc = subprocess.Popen(["/bin/sh", "-c", _WATCHDOG, grace, *cmd], stdin=read, **common)
    except BaseException:
        os.close(write)
        raise
    finally:
        os.close(read)
    return proc, write


_LAUNCHER: ThreadPoolExecutor | None = None


def in_lasting_thread(start: Callable[[], Any]) -> Any:
    """`start()` run in one thread that lives as long as this process: a server's parent-death signal follows
    the thread that started it, and a restart runs in a thread that ends soon after."""
    global _LAUNCHER
    if _LAUNCHER is None:
        _LAUNCHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-launcher")
    return _LAUNCHER.submit(start).result()


def _server_preexec(kill_with_parent: bool) -> Callable[[], None]:
    """The function that runs in the child between fork and exec; libc is loaded here, in the parent."""
    prctl = None
    if kill_with_parent:
        with suppress(OSError, AttributeError):
            import ctypes

            prctl = ctypes.CDLL(None, use_errno=True).prctl

    def preexec() -> None:
        block_stop_signals()
        widen_cpu_affinity()
        if prctl is not None:
            prctl(1, STOP_SIGNAL)  # PR_SET_PDEATHSIG

    return preexec


def widen_cpu_affinity() -> None:
    """Let the calling process run on every CPU its cpuset allows. A server inherits the CPU binding of the
    trainer rank that starts it (srun --cpus-per-task=12: 12 CPUs for a node's servers, their TP schedulers and
    helpers); the kernel narrows the request to the cpuset (the job's CPUs on the node), so this never leaves
    the allocation."""
    with suppress(OSError, AttributeError):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) == 0


def refuses_connections(host: str, port: int, patience_s: float = 0.0) -> bool:
    """Whether the port refuses connections (nothing listens), now or within `patience_s` (a killed process drops
    its connections a moment before its port closes). A port that does not answer is not refusing."""
    deadline = time.monotonic() + patience_s
    while True:
        with socket.socket() as s:
            s.settimeout(2.0)
            if s.connect_ex((host, port)) == errno.ECONNREFUSED:
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


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
    """STOP_SIGNAL to `proc`'s process group, SIGKILL it after `grace_s`; also SIGKILL the `children` (from
    `child_processes`) still alive, which may have left the group or outlived the parent. By PID,
    never by name."""
    if proc.poll() is None:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, STOP_SIGNAL)
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
