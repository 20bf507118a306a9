"""The trainer's stop signals reach every process of a job, as Slurm sends them, and SGLang
servers are children too.

- a server keeps serving through SIGTERM / SIGUSR1 to every process of its tree (they are the trainer's:
  it finishes its step and saves before it stops its servers, with SIGINT);
- a server hung in start-up and deaf to every signal is SIGKILLed, with its process group, a few seconds
  after its trainer was SIGKILLed (a watchdog beside it);
- SIGTERM while the trainer waits for its servers to come up stops them and the trainer at once: one line,
  exit 143 (there is nothing to save yet).
Default tier: the fake server of sglang_support. `-m sglang`: the trainer on a real server, the job signalled
after step 1; resume=auto finishes the run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from sglang_support import SGLANG_TIMEOUT, process_gone, server_ports
from support import logged_steps, one_line, run, signal_job, train_cmd, wait_for


def group_gone(pgid: int) -> bool:
    """No living process is left in process group `pgid`."""
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                return False
        except (psutil.Error, ProcessLookupError):
            continue
    return True


def wait_until(predicate, timeout: float) -> float:
    """Seconds until `predicate()` held; fails after `timeout`."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"not within {timeout:.0f} s"
        time.sleep(0.2)
    return time.monotonic() - t0


def test_a_server_keeps_serving_through_the_jobs_stop_signals(fake_python, tmp_path):
    engine = fake_python("serve")
    tree = [psutil.Process(engine.pid), *psutil.Process(engine.pid).children(recursive=True)]
    group = [p for p in psutil.process_iter() if os.getpgid(p.pid) == engine.pid]
    try:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            for proc in {*tree, *group}:
                os.kill(proc.pid, sig)
        time.sleep(1.0)
        assert engine.health(), engine.log_tail()
        with urllib.request.urlopen(engine.url + "/health", timeout=5) as r:
            assert r.status == 200
    finally:
        t0 = time.monotonic()
        engine.shutdown()
        took = time.monotonic() - t0
    wait_until(lambda: process_gone(engine.pid) and group_gone(engine.pid), timeout=5)  # SIGKILLed, reaped
    assert took < 1.5, f"shutdown took {took:.1f} s: the stop request (SIGINT) did not stop it"


WATCHED = """
import sys, time
from megatron_dapo.config import SGLangConfig
from megatron_dapo.rollout.sglang.engine import SGLangEngine
model, python, port, logs = sys.argv[1:]
engine = SGLangEngine(model, SGLangConfig(base_port=int(port)), python=python, device="cpu", log_dir=logs,
                      shutdown_grace_s=2, wait=False)
print(engine.pid, flush=True)
time.sleep(600)
"""


def test_a_hung_deaf_server_goes_with_its_sigkilled_trainer(fake_exe, tmp_path, python_env):
    """PR_SET_PDEATHSIG asks the server to stop and it does not: the watchdog SIGKILLs its group."""
    logs = tmp_path / "logs"
    trainer = subprocess.Popen([sys.executable, "-c", WATCHED, str(tmp_path), str(fake_exe), str(server_ports()),
                                str(logs)], env={**python_env, "FAKE_SGLANG_MODE": "deaf"},
                               stdout=subprocess.PIPE, text=True)
    try:
        server = int(trainer.stdout.readline())
        wait_until(lambda: any("is deaf" in f.read_text() for f in logs.glob("*.log")), timeout=60)
        time.sleep(3.0)  # longer than the watchdog's grace: a living trainer keeps its server
        assert not process_gone(server)
    finally:
        trainer.kill()  # SIGKILL, the trainer only: nothing of it runs any cleanup
        trainer.wait(timeout=30)
    took = wait_until(lambda: process_gone(server) and group_gone(server), timeout=20)
    print(f"the deaf server and its group were gone {took:.1f} s after the trainer")


@pytest.mark.parametrize("mode", ["hang", "deaf"])
def test_sigterm_while_the_servers_start_stops_at_once(base_dir, fake_exe, tmp_path, python_env, mode):
    """SIGTERM while the trainer waits for its servers (up to startup_timeout_s) stops it at once."""
    logs = Path(tempfile.gettempdir()) / "megatron-dapo-sglang"
    port = server_ports()
    cmd = train_cmd(base_dir, tmp_path, "starting", "rollout.engine=sglang", f"rollout.sglang.base_port={port}",
                    "rollout.sglang.startup_timeout_s=600", "train.steps=2")
    env = {**python_env, "MEGATRON_DAPO_SGLANG_PYTHON": str(fake_exe), "FAKE_SGLANG_MODE": mode}
    log = logs / f"sglang-127.0.0.1-{port}.log"
    log.unlink(missing_ok=True)  # an earlier server's on this port (the other mode's) would pass for this one's
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        wait_until(lambda: log.is_file() and "fake sglang" in log.read_text(), timeout=300)
        server = next(p.pid for p in psutil.Process(proc.pid).children(recursive=True)
                      if "fake_server.py" in " ".join(p.cmdline()))
        t0 = time.monotonic()
        signal_job(proc, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    one_line(subprocess.CompletedProcess(cmd, proc.returncode, "", stderr), 143,
             "train: preempted: stopped by SIGTERM while starting (nothing to save): no checkpoint yet")
    assert took < 10, f"the trainer took {took:.1f} s to stop"
    wait_until(lambda: process_gone(server) and group_gone(server), timeout=5)
    assert not (tmp_path / "ckpt" / "starting" / ".lock").exists()


# ------------------------------------------------------------------------------ real SGLang server


@pytest.mark.sglang
@SGLANG_TIMEOUT
def test_a_job_signal_on_a_real_server_saves_the_step_and_resumes(sglang_python, base_dir, tmp_path, env):
    cmd = train_cmd(base_dir, tmp_path, "sgterm", "rollout.engine=sglang", f"rollout.sglang.base_port={server_ports()}",
                    "train.steps=6", "eval.every_steps=0", "checkpoint.save_every=1", "checkpoint.export_hf=false")
    env = {**env, "MEGATRON_DAPO_SGLANG_PYTHON": sglang_python}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    marker = tmp_path / "ckpt" / "sgterm" / "step_00000001" / "COMPLETE"
    wait_for(lambda: marker.exists(), proc, timeout=900)
    signalled = signal_job(proc, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=600)
    line = one_line(subprocess.CompletedProcess(cmd, proc.returncode, "", stderr), 143,
                    "train: preempted: stopped by SIGTERM after step")
    assert any("sglang" in s for s in signalled), signalled  # the server's processes got it too
    step = int(line.split("after step ")[1].split(":")[0])
    assert (tmp_path / "ckpt" / "sgterm" / f"step_{step:08d}" / "COMPLETE").is_file(), line
    r = run(cmd, env, timeout=1200)
    assert r.returncode == 0 and f"resumed from {tmp_path / 'ckpt' / 'sgterm'}/step_{step:08d}" in r.stderr, \
        r.stderr[-4000:]
    assert logged_steps(tmp_path / "tb" / "sgterm") == set(range(1, 7))
