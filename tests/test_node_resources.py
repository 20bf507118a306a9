"""What a trainer rank hands the processes of its node in a multi-node job: the SGLang servers it starts run on
every CPU of the allocation, not the rank's own binding (rollout/sglang/process.py), and gloo's sockets use the
interface that carries the node's address, not the host name's (parallel.py). The launcher's GPU binding is
checked by tests/test_slurm.py's dry run."""

from __future__ import annotations

import os
import socket
import sys
import threading

import pytest
import torch.distributed as dist

from megatron_dapo import network, parallel
from megatron_dapo.config import ParallelConfig
from megatron_dapo.rollout.sglang.process import start_server_process


def _affinity_of_a_started_server(tmp_path, cpus: set[int]) -> set[int]:
    """Start a 'server' that prints its CPU affinity from a thread bound to `cpus` (as srun binds a rank)."""
    out = tmp_path / "affinity.log"
    seen: dict[str, object] = {}

    def launch() -> None:
        os.sched_setaffinity(0, cpus)  # this thread only: the test process keeps its own binding
        with open(out, "wb") as log:
            proc, _ = start_server_process([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                                           stdout=log, env=dict(os.environ), kill_with_parent=False, grace_s=1)
        seen["rc"] = proc.wait(timeout=60)

    t = threading.Thread(target=launch)
    t.start()
    t.join()
    assert seen["rc"] == 0, out.read_text()
    return set(eval(out.read_text().strip().splitlines()[-1]))


def test_a_server_started_from_a_bound_rank_runs_on_every_cpu(tmp_path):
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs 2 CPUs to bind a rank to fewer than the node has")
    first = {min(allowed)}
    assert _affinity_of_a_started_server(tmp_path, first) == allowed


def test_gloo_uses_the_interface_of_the_node_address_across_nodes(monkeypatch):
    """A host name that resolves to 127.0.1.1 makes gloo bind loopback: cross-node init then hangs."""
    import psutil

    addr = lambda family, address: type("A", (), {"family": family, "address": address})()  # noqa: E731
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: {"lo": [addr(socket.AF_INET, "127.0.0.1")],
                                                        "ib0": [addr(socket.AF_INET, "10.1.2.3")]})
    monkeypatch.setattr(network, "node_address", lambda master, environ=None: "10.1.2.3")
    for k in [k for k in os.environ if k.startswith(("SLURM_", "TORCHELASTIC_"))] + ["GLOO_SOCKET_IFNAME"]:
        monkeypatch.setenv(k, "")  # recorded, so the ib0 that initialize() sets is undone at teardown
        monkeypatch.delenv(k)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    seen = {}

    class Stop(Exception):
        pass

    def init(*args, **kwargs):
        seen["ifname"] = os.environ.get("GLOO_SOCKET_IFNAME")
        raise Stop

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init)
    with pytest.raises(Stop):
        parallel.initialize(ParallelConfig(), seed=0)
    assert seen["ifname"] == "ib0"


def test_one_host_under_torchrun_is_left_to_gloo():
    env = parallel.LaunchEnv(0, 4, 0, "127.0.0.1", 29500)
    assert not parallel.several_hosts(env, {"TORCHELASTIC_USE_AGENT_STORE": "true", "LOCAL_WORLD_SIZE": "4"})
    assert parallel.several_hosts(env, {"TORCHELASTIC_USE_AGENT_STORE": "true", "LOCAL_WORLD_SIZE": "2"})
    assert parallel.several_hosts(env, {"SLURM_JOB_NUM_NODES": "2"})


def test_gloo_keeps_an_interface_the_user_set(monkeypatch):
    monkeypatch.setattr(network, "node_address", lambda master, environ=None: "10.1.2.3")
    assert network.gloo_interface("10.1.2.1", {"GLOO_SOCKET_IFNAME": "eth7"}) == "eth7"
    monkeypatch.setattr(network, "node_address", lambda master, environ=None: "10.250.0.1")  # held by no interface
    assert network.gloo_interface("10.1.2.1", {}) is None
