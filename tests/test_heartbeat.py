"""A driver that is alive but hung is noticed: two real processes (gloo, the store served by the driver's
process, as in a one-node job); the driver says it generates step 2's rollout, the other rank waits for it in
join_driver. A slow driver is waited for; a SIGSTOPped one makes the other rank stop with one line naming the
driver's phase, after parallel.driver_heartbeat_timeout_s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from support import one_line

from megatron_dapo.parallel import free_port

TIMEOUT_S = 2.0
RANK = """
import os, sys, time
from datetime import timedelta
import torch.distributed as dist
from megatron_dapo import parallel
from megatron_dapo.cli import print_error
from megatron_dapo.heartbeat import DriverHungError
rank, port, timeout = int(os.environ["RANK"]), os.environ["MASTER_PORT"], float(sys.argv[1])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=60))
parallel.start_heartbeat(timeout)
print("ready", flush=True)
if rank == 0:
    parallel.driver_phase("rollout of step 2")
    time.sleep(600)  # a long rollout
try:
    parallel.join_driver("rollout")
except DriverHungError as e:
    print_error("train", e)
    dist.destroy_process_group()
    sys.exit(1)
"""


def start(rank: int, port: int, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RANK, str(TIMEOUT_S)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**env, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_PORT": str(port)})


def test_a_stopped_driver_stops_the_waiting_rank_with_one_line_naming_its_phase(env):
    port = free_port()
    driver, waiter = start(0, port, env), start(1, port, env)
    try:
        assert driver.stdout.readline() == "ready\n" and waiter.stdout.readline() == "ready\n", \
            (driver.poll(), waiter.poll())
        time.sleep(2 * TIMEOUT_S)  # the driver is slow but alive: its thread beats, the rank waits on
        assert waiter.poll() is None, waiter.communicate()
        os.kill(driver.pid, signal.SIGSTOP)  # alive, hung: the store it serves stops answering too
        t0 = time.monotonic()
        _, stderr = waiter.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        for proc in (driver, waiter):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # a stopped process dies of SIGKILL too
            proc.wait(timeout=30)
    line = one_line(subprocess.CompletedProcess([], waiter.returncode, "", stderr), 1,
                    "train: error: [rank 1] the driver (rank 0) has sent no heartbeat",
                    f"driver_heartbeat_timeout_s={TIMEOUT_S:g}", "its last phase: rollout of step 2")
    assert TIMEOUT_S - 0.5 < took < TIMEOUT_S + 15, (took, line)
    print(f"stopped {took:.1f} s after the SIGSTOP: {line}")
