"""Several SGLang servers (rollout.sglang.num_servers, one per rollout TP group) behind one engine.

Default tier: launching against the fake server (ports, shutdown, a server that cannot start stops
the others). `-m sglang`: two REAL servers on CPU: prompts split across them give the same samples
and teacher-forced logprobs as one model, and a weight update reaches both.
"""

from __future__ import annotations

import os
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
def test_two_real_servers_split_prompts_and_take_weight_updates_both_ways(sglang_python, models, hf, tmp_path):
    """Two servers of one group split the prompts; the weights reach both, streamed over HTTP (the tensor
    transport) and then with the distributed transport: both servers join ONE group (world 1 + 1 + 1) and
    every bucket is broadcast once."""
    import torch

    from megatron_dapo.rollout.sglang.updates import NodeWeightSync

    t0 = time.monotonic()
    group = launch_servers(models["a"], SGLangConfig(base_port=server_ports(2), num_servers=2,
                                                     startup_timeout_s=600, request_timeout_s=300),
                           python=sglang_python, dtype="float32", max_total_tokens=8192,
                           log_dir=tmp_path / "logs", bucket_mb=1)
    print(f"\ntwo SGLang servers up in {time.monotonic() - t0:.1f} s: {group.names}")  # type: ignore[attr-defined]  # an EngineGroup
    servers = group.engines  # type: ignore[attr-defined]  # SGLang engines
    pids = [e.pid for e in servers]
    sync = None
    try:
        greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
        groups = group.generate(PROMPTS, 2, greedy)
        assert [s.prompt_ids for g in groups for s in g] == [list(p) for p in PROMPTS for _ in range(2)]
        assert max_logprob_diff(hf["a"], groups) < 1e-4
        group.update_weights(hf["b"].state_dict().items())  # streamed to both servers at once
        sampled = group.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_new_tokens=6))
        per_server = [sampled[:3], sampled[3:]]  # prompts 0-2 went to server 0, 3-4 to server 1
        assert all(max_logprob_diff(hf["b"], part) < 1e-4 for part in per_server)

        sync = NodeWeightSync.local(servers, transport="distributed", bucket_bytes=64 * 1024)  # several buckets
        counts = sync.update(hf["a"].state_dict().items())
        assert counts.error is None and counts.buckets >= 2
        assert torch.distributed.get_world_size(sync._broadcast.pg) == 3
        assert counts.sent == counts.bytes  # each bucket sent once for both servers
        sampled = group.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_new_tokens=6))
        assert max_logprob_diff(hf["a"], sampled[:3]) < 1e-4 and max_logprob_diff(hf["a"], sampled[3:]) < 1e-4
        assert sync.update(hf["b"].state_dict().items()).error is None  # the group is reused
        assert max_logprob_diff(hf["b"], group.generate(PROMPTS, 1, SamplingParams(max_new_tokens=4))) < 1e-4
    finally:
        if sync is not None:
            sync.shutdown()
        group.shutdown()
    assert all(process_gone(pid) for pid in pids)


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
