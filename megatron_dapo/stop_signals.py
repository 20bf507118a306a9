"""SIGTERM and SIGUSR1 belong to the trainer: the processes it starts must not die of them.

Slurm sends its stop signals to every process of a job step (scancel, preemption, the time limit, and
what srun forwards), not only to the trainer; a kill of the process group does the same. The trainer then
finishes its step and saves it (loop/preempt.py), which needs its helpers alive: megatron-core's checkpoint
writer processes, multiprocessing's resource tracker, torch's shared-memory manager, the SGLang servers.
So every helper starts with these signals blocked, a state a child inherits through fork and exec (a
handler or an ignored disposition would not survive the exec, or the helper replaces it, as uvicorn does).
The helpers go away as they always did: by a message, SIGINT (rollout/sglang/process.py), or SIGKILL.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def block_stop_signals() -> None:
    """Block STOP_SIGNALS in the calling thread; in a child between fork and exec (a Popen preexec_fn), the
    block holds for the program it runs and everything that program starts."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


@contextmanager
def helpers_shielded() -> Iterator[None]:
    """Processes started inside the block by this thread, by our code or a library's, inherit STOP_SIGNALS
    blocked. The calling process still gets them: another thread takes the signal, or it waits until the
    block ends."""
    from multiprocessing import resource_tracker

    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        # multiprocessing's resource tracker, started here if it is not running, inherits SIGUSR1 blocked (it
        # ignores SIGTERM itself); starting it UNBLOCKS SIGTERM in this thread (CPython 3.11 restores no mask),
        # so the block is set again after it.
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
