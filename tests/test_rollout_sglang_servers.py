"""Several SGLang servers (rollout.sglang.num_servers, one per rollout TP group) behind one engine.

Default tier: launching against the fake server (ports, shutdown, a server that cannot start stops
the others). `-m sglang`: two REAL servers on CPU: prompts split across them give the same samples
and teacher-forced logprobs as one model, and a weight update reaches both.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from typing import Any

import pytest
from sglang_support import SGLANG_TIMEOUT, process_gone, max_logprob_diff, server_ports

from megatron_dapo.config import SGLangConfig
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.engine_group import EngineGroup
from megatron_dapo.rollout.sglang.engine import SGLangEngine
from megatron_dapo.rollout.sglang.fleet import launch_servers
from megatron_dapo.rollout.sglang.server import SGLangServerError


def _trainer_cmd(base, tmp_path, run: str, *overrides: str) -> list[str]:
    """`python -m megatron_dapo.train` on the session's tiny base (`base`) with SGLang rollouts: test_train's
    small two-step settings, then `overrides` (later ones win)."""
    from support import train_cmd

    return train_cmd(base, tmp_path, run, "rollout.engine=sglang", "train.steps=2", "checkpoint.save_every=0",
                     "checkpoint.export_hf=false", *overrides)


def test_one_server_is_a_plain_engine(fake_exe, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_MODE", "serve")
    engine = launch_servers(tmp_path, SGLangConfig(base_port=server_ports()), python=str(fake_exe), device="cpu",
                            log_dir=tmp_path / "logs", shutdown_grace_s=2)
    try:
        assert isinstance(engine, SGLangEngine) and engine.health()
    finally:
        engine.shutdown()


def test_servers_take_consecutive_ports_and_stop_together(fake_exe, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_MODE", "serve")
    port = server_ports(2)
    group = launch_servers(tmp_path, SGLangConfig(base_port=port, num_servers=2), python=str(fake_exe),
                           device="cpu", log_dir=tmp_path / "logs", shutdown_grace_s=2)
    assert isinstance(group, EngineGroup)
    assert group.names == [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
    pids = [e.pid for e in group.engines]  # type: ignore[attr-defined]  # SGLang engines
    assert group.health()
    group.shutdown()
    assert all(process_gone(pid) for pid in pids)


def test_a_server_that_cannot_start_stops_the_others(fake_exe, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_MODE", "serve")
    port = server_ports(2)
    spawned: list[SGLangEngine] = []
    original = SGLangEngine._start

    def start(self):
        spawned.append(self)
        original(self)

    monkeypatch.setattr(SGLangEngine, "_start", start)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        with pytest.raises(SGLangServerError, match=f"127.0.0.1:{port + 1}: the port is already in use"):
            launch_servers(tmp_path, SGLangConfig(base_port=port, num_servers=2), python=str(fake_exe),
                           device="cpu", log_dir=tmp_path / "logs", shutdown_grace_s=2)
    assert spawned and spawned[0].pid is not None and process_gone(spawned[0].pid)


PROMPTS = [[5, 6, 7], [9, 9], [17, 33, 65, 129, 200], [40, 41], [3]]


@pytest.mark.sglang
@SGLANG_TIMEOUT
def test_two_real_servers_split_prompts_and_both_take_weight_updates(sglang_python, models, hf, tmp_path):
    t0 = time.monotonic()
    group = launch_servers(models["a"], SGLangConfig(base_port=server_ports(2), num_servers=2,
                                                     startup_timeout_s=600, request_timeout_s=300),
                           python=sglang_python, dtype="float32", max_total_tokens=8192,
                           log_dir=tmp_path / "logs", bucket_mb=1)
    print(f"\ntwo SGLang servers up in {time.monotonic() - t0:.1f} s: {group.names}")  # type: ignore[attr-defined]  # an EngineGroup
    pids = [e.pid for e in group.engines]  # type: ignore[attr-defined]  # SGLang engines
    try:
        greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
        groups = group.generate(PROMPTS, 2, greedy)
        assert [s.prompt_ids for g in groups for s in g] == [list(p) for p in PROMPTS for _ in range(2)]
        assert max_logprob_diff(hf["a"], groups) < 1e-4
        group.update_weights(hf["b"].state_dict().items())  # streamed to both servers at once
        sampled = group.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_new_tokens=6))
        per_server = [sampled[:3], sampled[3:]]  # prompts 0-2 went to server 0, 3-4 to server 1
        assert all(max_logprob_diff(hf["b"], part) < 1e-4 for part in per_server)
    finally:
        group.shutdown()
    assert all(process_gone(pid) for pid in pids)


@pytest.mark.sglang
@SGLANG_TIMEOUT
def test_one_broadcast_updates_several_servers(sglang_python, models, hf, tmp_path):
    """A node's servers with the distributed transport: both join ONE group (world 1 + 1 + 1) and every
    bucket is broadcast once."""
    import torch

    from megatron_dapo.rollout.sglang.updates import NodeWeightSync

    port = server_ports(2)
    servers = [SGLangEngine(models["a"], SGLangConfig(base_port=port, startup_timeout_s=600, request_timeout_s=300),
                            python=sglang_python, server_index=k, dtype="float32", max_total_tokens=8192,
                            log_dir=tmp_path / "logs", bucket_mb=1, wait=False) for k in range(2)]
    sync = NodeWeightSync.local(servers, transport="distributed", bucket_bytes=64 * 1024)  # several buckets
    group = EngineGroup(servers)
    try:
        for s in servers:
            s.wait_ready()
        counts = sync.update(hf["b"].state_dict().items())
        assert counts.error is None and counts.buckets >= 2
        assert torch.distributed.get_world_size(sync._broadcast.pg) == 3
        assert counts.sent == counts.bytes  # each bucket sent once for both servers
        sampled = group.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_new_tokens=6))
        assert max_logprob_diff(hf["b"], sampled[:3]) < 1e-4 and max_logprob_diff(hf["b"], sampled[3:]) < 1e-4
        assert sync.update(hf["a"].state_dict().items()).error is None  # the group is reused
        assert max_logprob_diff(hf["a"], group.generate(PROMPTS, 1, SamplingParams(max_new_tokens=4))) < 1e-4
    finally:
        sync.shutdown()
        group.shutdown()


@pytest.mark.sglang
@SGLANG_TIMEOUT
def test_trainer_with_two_sglang_servers(sglang_python, base_dir, tmp_path, python_env):
    """The DAPO loop end to end on real SGLang servers: colocated sleep/wake, weight sync to both servers
    after every step, and the servers' logprobs equal the actor's on the tokens they sampled."""
    import subprocess

    from megatron_dapo.metrics import read_scalars

    cmd = _trainer_cmd(base_dir, tmp_path, "sglang2", "rollout.sglang.num_servers=2",
                       f"rollout.sglang.base_port={server_ports(2)}")
    env = {**python_env, "MEGATRON_DAPO_SGLANG_PYTHON": sglang_python}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    assert r.returncode == 0, r.stderr[-6000:]
    tb = read_scalars(tmp_path / "tb" / "sglang2")
    assert set(tb["train/reward_mean"]) == {1, 2} and set(tb["val/acc_avg_at_k"]) == {0, 2}
    assert max(tb["rollout/train_rollout_logprob_absdiff"].values()) < 1e-4
    assert min(tb["perf/weight_sync_bytes"].values()) > 0


@pytest.mark.sglang
@SGLANG_TIMEOUT
def test_async_trainer_generates_the_next_batch_on_a_server_of_its_own(sglang_python, base_dir, tmp_path,
                                                                       python_env):
    """rollout.async_steps=1 on a real SGLang server (not colocated): the producer thread drives the server
    over HTTP while the actor trains, batches 2 and 3 are one version old, the weights reach the server at
    each boundary (the probe checks them) and the correction sees the gap."""
    import subprocess

    from megatron_dapo.metrics import read_scalars

    cmd = _trainer_cmd(base_dir, tmp_path, "async", f"rollout.sglang.base_port={server_ports()}",
                       "rollout.colocate=false",
                       "rollout.async_steps=1", "train.steps=3", "eval.every_steps=0")
    env = {**python_env, "MEGATRON_DAPO_SGLANG_PYTHON": sglang_python}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    assert r.returncode == 0, r.stderr[-6000:]
    tb = read_scalars(tmp_path / "tb" / "async")
    assert tb["rollout/staleness_mean"] == {1: 0.0, 2: 1.0, 3: 1.0}
    assert set(tb["rollout_corr/weight_mean"]) == {1, 2, 3} and set(tb["timing/overlap_s"]) == {1, 2, 3}
    assert max(tb["rollout/weight_sync_probe_absdiff"].values()) < 0.01


@pytest.mark.sglang
@SGLANG_TIMEOUT
def test_torchrun_trainer_with_the_distributed_weight_transport(sglang_python, base_dir, tmp_path, python_env):
    """Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True, RANK / MASTER_PORT of the trainer set) the server
    starts in a clean environment and answers /health, and the weight group serves its own store: both
    steps sync over the broadcast group (servers on their own devices), and step 2's rollout logprobs equal
    the actor's."""
    import subprocess
    import sys

    from megatron_dapo.metrics import read_scalars
    from megatron_dapo.parallel import free_port as free_master_port

    cmd = _trainer_cmd(base_dir, tmp_path, "torchrun", f"rollout.sglang.base_port={server_ports()}",
                       "rollout.sglang.weight_sync=distributed", "rollout.colocate=false",
                       "eval.every_steps=0")
    assert cmd[1:3] == ["-m", "megatron_dapo.train"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
           str(free_master_port()), "-m", "megatron_dapo.train", *cmd[3:]]
    env = {**python_env, "MEGATRON_DAPO_SGLANG_PYTHON": sglang_python}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    assert r.returncode == 0, r.stderr[-6000:]
    tb = read_scalars(tmp_path / "tb" / "torchrun")
    assert set(tb["perf/weight_sync_bytes"]) == {1, 2} and min(tb["perf/weight_sync_bytes"].values()) > 0
    assert tb["rollout/train_rollout_logprob_absdiff"][2] < 1e-4


@pytest.mark.sglang
@SGLANG_TIMEOUT
def test_three_nodes_each_start_a_server_and_rank0_drives_all(sglang_python, base_dir, tmp_path, python_env):
    """Three trainer ranks posing as three nodes (GROUP_RANK 0, 1, 2): each node's leader starts its own
    server and updates it from its own copy of the weights (node-local, tensor transport); rank 0 drives all
    three for generation, nodes 1 and 2 attached. After each step's sync every server's logprobs equal the
    actor's (the prompts are split across all three); no weight byte crossed a node, and rank 0 sent one
    model (to its own server), not one per node."""
    import subprocess

    from megatron_dapo.metrics import read_scalars
    from megatron_dapo.parallel import free_port as free_master_port

    cmd = _trainer_cmd(base_dir, tmp_path, "nodes3", f"rollout.sglang.base_port={server_ports(3)}",
                       "parallel.backend=gloo",
                       "train.prompt_batch_size=6", "train.mini_batch_size=3", "eval.every_steps=0")
    master = str(free_master_port())
    procs = []
    for rank in range(3):
        env = {**python_env, "MEGATRON_DAPO_SGLANG_PYTHON": sglang_python, "RANK": str(rank), "WORLD_SIZE": "3",
               "LOCAL_RANK": "0", "GROUP_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master,
               "DAPO_NODE_ADDR": "127.0.0.1"}
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=1200)[0])
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n=====\n".join(o[-5000:] for o in outs)
    line = next(x for x in outs[0].splitlines() if "SGLang servers:" in x)
    assert line.count("(attached)") == 2 and "from the node's own ranks (tensor)" in line, line
    tb = read_scalars(tmp_path / "tb" / "nodes3")
    assert set(tb["train/reward_mean"]) == {1, 2}
    assert max(tb["rollout/train_rollout_logprob_absdiff"].values()) < 1e-4
    model = tb["perf/weight_sync_bytes"]
    assert set(tb["perf/weight_sync_bytes_cross_node"].values()) == {0.0}
    assert all(0 < tb["perf/weight_sync_bytes_sent_rank0"][s] <= model[s] for s in model)


def _job_worker(rank, world, master_port, exe, root, base_port, block_node1):
    import json
    import os
    from pathlib import Path

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", GROUP_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port), DAPO_NODE_ADDR="127.0.0.1",
                      FAKE_SGLANG_MODE="serve")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron_dapo.rollout.sglang.fleet import start_job_servers

    blocker = None
    if block_node1 and rank == 1:
        blocker = socket.socket()
        blocker.bind(("127.0.0.1", base_port + 1))
        blocker.listen()
    out: dict = {}
    try:
        job = start_job_servers(root, SGLangConfig(base_port=base_port), python=exe, device="cpu",
                                log_dir=Path(root) / "logs", shutdown_grace_s=2)
        eng = job.engine
        out["owned"] = [e.url for e in job.owned]
        out["weights"] = [job.weights.leader, [e.url for e in job.weights.servers], job.weights.transport]
        if eng is not None:
            parts: list[Any] = eng.engines if isinstance(eng, EngineGroup) else [eng]
            out["engine"] = [(e.url, e.cfg.weight_sync, e.attached, e.trainer_host) for e in parts]
            out["healthy"] = eng.health()
        dist.barrier()
        job.shutdown()
    except SGLangServerError as e:
        out["error"] = str(e)
    finally:
        if blocker is not None:
            blocker.close()
    Path(root, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


@pytest.mark.parametrize("block_node1", [False, True], ids=["both_start", "node1_fails"])
def test_every_node_leader_starts_servers_and_rank0_attaches(fake_exe, tmp_path, block_node1):
    import json

    from spawn import run_ranks

    port = server_ports(2)
    run_ranks(_job_worker, str(fake_exe), str(tmp_path), port, block_node1, timeout_s=180)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    if block_node1:  # every rank fails, naming the node that could not start its server
        for r in (r0, r1):
            assert "node 1 (127.0.0.1)" in r["error"] and "port is already in use" in r["error"]
        return
    local, remote = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"
    assert [(url, attached) for url, _, attached, _ in r0["engine"]] == [(local, False), (remote, True)]
    assert r0["healthy"] and r0["owned"] == [] and r1["owned"] == [remote] and "engine" not in r1
    # weights: each node's leader updates its own node's servers, rank 0 only its own
    assert r0["weights"] == [True, [local], "tensor"] and r1["weights"] == [True, [remote], "tensor"]


@pytest.mark.sglang
@SGLANG_TIMEOUT
def test_a_server_killed_mid_rollout_is_restarted_and_the_run_trains_full_batches(sglang_python, base_dir,
                                                                                 tmp_path, python_env):
    """SIGKILL one of two real servers while it generates (step 1 or 2): its groups are generated by the other,
    it starts again on its port, takes the weights at the step's sync (the probe scores both servers), and both
    steps train a full batch (8 groups)."""
    import subprocess

    import psutil

    from megatron_dapo.metrics import read_scalars

    port = server_ports(2)
    cmd = _trainer_cmd(base_dir, tmp_path, "restart", "rollout.sglang.num_servers=2", f"rollout.sglang.base_port={port}",
                       "eval.every_steps=0")
    env = {**python_env, "MEGATRON_DAPO_SGLANG_PYTHON": sglang_python, "TMPDIR": str(tmp_path)}
    log = tmp_path / "megatron-dapo-sglang" / f"sglang-127.0.0.1-{port + 1}.log"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline, killed = time.monotonic() + 600, None
        while killed is None and proc.poll() is None and time.monotonic() < deadline:
            # a batch of several sequences: step 1's groups (start-up's warm-up and health checks send one each)
            if log.is_file() and re.search(r"Prefill batch, #new-seq: [2-9]", log.read_text(errors="replace")):
                listeners = [c.pid for c in psutil.net_connections("tcp")
                             if c.laddr and c.laddr.port == port + 1 and c.status == psutil.CONN_LISTEN]
                killed = listeners[0]
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.02)
        assert killed is not None, "the second server never generated"
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-6000:]
    assert "exited with code -9; restarting it (restart 1 of at most 3 this run)" in err
    tb = read_scalars(tmp_path / "tb" / "restart")
    assert tb["rollout/engine_restarts"][2] == 1 and tb["rollout/resubmitted_groups"][2] >= 1  # run totals
    assert tb["rollout/groups_trained"] == {1: 8.0, 2: 8.0}
    assert max(tb["rollout/weight_sync_probe_absdiff"].values()) < 0.01
