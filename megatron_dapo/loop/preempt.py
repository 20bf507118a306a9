"""Preemption: SIGTERM or SIGUSR1 asks the run to stop at the end of the current step, with a checkpoint.

Slurm sends SIGTERM before it kills a job (scancel, preemption, requeue, the time limit), or a chosen
signal ahead of the time limit (`#SBATCH --signal=B:USR1@120`; the launcher forwards it to the
trainer), to every process of the job: the processes the trainer starts block both (stop_signals.py) and
keep serving until it has saved. The handler only records the signal; after each step every rank learns
whether any rank got one (one all-reduce), so all of them save the same step and stop together. The step
in flight is finished, not abandoned: ask for the signal at least one step plus one save before the
deadline. A second signal (REPEAT_AFTER_S later) stops the process at once. While the run starts (model,
servers, data) there is nothing to save: the first signal interrupts the start at once
(`StartInterrupted`), the servers are stopped and the run exits with 128 + the signal. Ctrl-C (SIGINT) stops
at once, without saving. Each is acknowledged on the driver the moment it arrives, in one line of the log
("SIGTERM received: finishing step 3, then saving"); the final line comes when the run has stopped.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

from megatron_dapo.stop_signals import STOP_SIGNALS

log = logging.getLogger(__name__)

SIGNALS = STOP_SIGNALS
REPEAT_AFTER_S = 5.0
"""A second signal stops the process at once only this long after the first: Slurm may deliver one twice
(to every process of the step, and again as srun forwards what it got)."""


class Preempted(Exception):
    """The run stopped on a signal after saving `checkpoint` at `step`, or while starting (`step` None:
    `checkpoint` is the last complete one); exit code 128 + signal number."""

    def __init__(self, signum: int, step: int | None, checkpoint: str | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        if step is None:
            last = f"last complete checkpoint {checkpoint}" if checkpoint else "no checkpoint yet"
            super().__init__(f"stopped by {name} while starting (nothing to save): {last}; "
                             "checkpoint.resume=auto continues from it")
            return
        saved = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint yet"
        super().__init__(f"stopped by {name} after step {step}: {saved}; "
                         "checkpoint.resume=auto continues from it")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StartInterrupted(BaseException):
    """Raised by the first stop signal while the run starts. A BaseException, as KeyboardInterrupt, so that
    no `except Exception` on the way (a server launch reporting failures, say) takes it for an error."""


class StopSignals:
    """Records SIGTERM / SIGUSR1 instead of dying; `requested()` is the collective verdict."""

    def __init__(self) -> None:
        self.signum = 0
        self.starting = True
        """Until `started()`: the first signal raises StartInterrupted, later ones are only recorded."""
        self.step: int | None = None
        """The step in flight, which a stop signal lets finish (None: the last one is done)."""
        self._first_at = 0.0
        self._interrupted = False
        self._previous: dict[int, Any] = {}

    def install(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupt)
        return self

    def started(self) -> None:
        self.starting = False

    def _record(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.starting:
            first, self.signum = not self.signum, self.signum or signum
            if first:
                acknowledge(f"{name} received while starting: stopping (nothing to save yet)")
                raise StartInterrupted(signum)
            return
        if self.signum and time.monotonic() - self._first_at > REPEAT_AFTER_S:
            signal.signal(signum, signal.SIG_DFL)  # asked twice: stop now, as the signal stops a process
            os.kill(os.getpid(), signum)
        if not self.signum:
            self.signum, self._first_at = signum, time.monotonic()
            doing = f"finishing step {self.step}, then saving" if self.step is not None else \
                "the last step is done: finishing the run"
            acknowledge(f"{name} received: {doing} (rerun the same command to resume; a second {name} "
                        f"more than {REPEAT_AFTER_S:g} s later stops at once)")

    def _interrupt(self, signum: int, frame: object) -> None:
        if not self._interrupted:
            self._interrupted = True
            lost = f", step {self.step} is not saved" if self.step is not None and not self.starting else ""
            acknowledge(f"Ctrl-C received: stopping now{lost} (the last complete checkpoint is kept)")
        raise KeyboardInterrupt

    def requested(self) -> int:
        """Collective: the signal any rank received (0 if none), the same on every rank."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([float(self.signum)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def acknowledge(message: str) -> None:
    """`message` as one log line on stderr at once, on the driver only (every rank gets the job's signals).
    From a signal handler: straight to the file descriptor, without logging's locks or the buffered stream,
    which the interrupted code may be writing to."""
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) != "0":
        return
    handlers = logging.getLogger().handlers
    formatter = (handlers[0].formatter if handlers else None) or logging.Formatter(
        "%(levelname)s %(name)s: %(message)s")
    record = log.makeRecord(log.name, logging.WARNING, __file__, 0, message, None, None)
    try:
        os.write(2, (formatter.format(record) + "\n").encode())
    except OSError:
        pass
