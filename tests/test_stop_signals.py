"""helpers_shielded (megatron_dapo/stop_signals.py): the processes started inside it, multiprocessing's resource
tracker included, keep the job's stop signals blocked; the calling thread gets its mask back."""

import json
import signal
import subprocess
import sys
from pathlib import Path

from megatron_dapo.stop_signals import STOP_SIGNALS

# A fresh process (the tracker is not running yet, as in a trainer before its first save) starts a helper and
# the tracker inside the block, then reports their PIDs and its own mask before and after.
PROBE = """
import json, signal, subprocess, sys
from multiprocessing import resource_tracker
from megatron_dapo.stop_signals import helpers_shielded
before = sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))
with helpers_shielded():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
after = sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))
print(json.dumps({"child": child.pid, "tracker": resource_tracker._resource_tracker._pid, "before": before,
                  "after": after}), flush=True)
sys.stdin.read()  # keep both alive until the test has looked
child.kill()
"""


def blocked(pid: int) -> set[int]:
    """The signals blocked in process `pid` (its /proc status' SigBlk mask)."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("SigBlk:"))
    mask = int(line.split()[1], 16)
    return {n for n in range(1, 65) if mask & (1 << (n - 1))}


def test_helpers_started_inside_keep_the_stop_signals_blocked():
    proc = subprocess.Popen([sys.executable, "-c", PROBE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        seen = json.loads(proc.stdout.readline())
        assert {int(s) for s in STOP_SIGNALS} <= blocked(seen["child"])
        assert int(signal.SIGUSR1) in blocked(seen["tracker"])  # it ignores SIGTERM itself
        assert seen["after"] == seen["before"]
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
