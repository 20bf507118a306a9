"""Preemption: SIGTERM or SIGUSR1 asks the run to stop at the end of the current step, with a checkpoint.

Slurm sends SIGTERM before it kills a job (scancel, preemption, requeue, the time limit), or a chosen
signal ahead of the time limit (`#SBATCH --signal=B:USR1@120`; the launcher forwards it to the
trainer). The handler only records the signal; after each step every rank learns whether any rank got
one (one all-reduce), so all of them save the same step and stop together. The step in flight is
finished, not abandoned: ask for the signal at least one step plus one save before the deadline.
A second signal stops the process at once.
"""

from __future__ import annotations

import os
import signal
import threading

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """The run stopped on a signal after saving `checkpoint` (exit code 128 + signal number)."""

    def __init__(self, signum: int, step: int, checkpoint: str | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        saved = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint yet"
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}: {saved}; "
                         "checkpoint.resume=auto continues from it")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignals:
    """Records SIGTERM / SIGUSR1 instead of dying; `requested()` is the collective verdict."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, object] = {}

    def install(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def _record(self, signum: int, frame: object) -> None:
        if self.signum:  # asked twice: stop now, the way the signal stops a process by default
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.signum = signum

    def requested(self) -> int:
        """Collective: the signal any rank received (0 if none), the same on every rank."""
        flag = torch.tensor([float(self.signum)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
