"""A stop signal is acknowledged the moment it arrives, in one log line, not only when the run has stopped:
SIGTERM / SIGUSR1 lets the step in flight finish and be saved, Ctrl-C stops at once without saving it. The
process below stands for the trainer in its step 3 (a Python loop, as the rollout and the updates are); the
signal goes to its whole process group, as Slurm and a terminal send it, and its stderr is read while it still
runs. (test_reliability.py checks the same lines from the trainer itself, slow tier.)"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest

STEP = """
import logging, time
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
from megatron_dapo.loop.preempt import StopSignals
stop = StopSignals().install()
stop.started()
stop.step = 3
print("ready", flush=True)
try:
    for _ in range(600):  # step 3
        time.sleep(0.1)
except KeyboardInterrupt:
    time.sleep(60)  # stopping the servers
"""


@pytest.mark.parametrize("sig, expected", [
    (signal.SIGTERM, "SIGTERM received: finishing step 3, then saving (rerun the same command to resume"),
    (signal.SIGUSR1, "SIGUSR1 received: finishing step 3, then saving"),
    (signal.SIGINT, "Ctrl-C received: stopping now, step 3 is not saved (the last complete checkpoint is kept)"),
], ids=["SIGTERM", "SIGUSR1", "SIGINT"])
def test_a_stop_signal_is_acknowledged_at_once(python_env, sig, expected):
    proc = subprocess.Popen([sys.executable, "-c", STEP], env=python_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline() == "ready\n", proc.communicate()
        os.killpg(proc.pid, sig)
        t0 = time.monotonic()
        ready, _, _ = select.select([proc.stderr], [], [], 20)
        line = proc.stderr.readline() if ready else ""
        took, running = time.monotonic() - t0, proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert expected in line and "WARNING megatron_dapo.loop.preempt" in line, line
    assert line[:4].isdigit(), line  # a log record: the run's one final error line stays the only one
    assert running and took < 5, (running, took)
