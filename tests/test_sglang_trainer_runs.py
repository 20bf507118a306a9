"""Training runs on real SGLang servers on CPU (`-m sglang`): an async trainer with a server of its own,
torchrun with the distributed weight transport and multi-turn tool rollouts, three nodes each starting one (one
of them killed mid-stream and restarted by its own node while the others generate its groups), and a lone server
killed, then hung, mid-rounds and restarted with the current weights (issue 38). Split from
test_rollout_sglang_servers.py so that the two long files run on two workers."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from sglang_support import SGLANG_TIMEOUT, server_ports, trainer_cmd


@pytest.mark.sglang
@SGLANG_TIMEOUT
def test_async_trainer_generates_the_next_batch_on_a_server_of_its_own(sglang_python, base_dir, tmp_path,
                                                                       python_env):
    """rollout.async_steps=1 on a real SGLang server (not colocated): the producer thread drives the server
    over HTTP while the actor trains, batches 2 and 3 are one version old, the weights reach the server at
    each boundary (the probe checks them) and the correction sees the gap."""
    import subprocess

    from megatron_dapo.metrics import read_scalars

    cmd = trainer_cmd(base_dir, tmp_path, "async", f"rollout.sglang.base_port={server_ports()}",
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
def test_torchrun_trainer_with_the_distributed_weight_transport_and_tool_calls(sglang_python, base_dir, tmp_path,
                                                                               python_env):
    """Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True, RANK / MASTER_PORT of the trainer set) the server
    starts in a clean environment and answers /health, and the weight group serves its own store: both
    steps sync over the broadcast group (servers on their own devices). The rollouts are multi-turn (issue 37: a
    user tool, tests/workers/echo_tool.py; the tiny base's chance fences as in test_tools_train): the server
    continues every row from its token ids, so step 2's rollout logprobs equal the actor's on every sampled token
    of the multi-turn rows (a continuation conditioned on other ids, or an observation in the loss, breaks it)."""
    import json
    import subprocess
    import sys

    from megatron_dapo.metrics import read_scalars
    from megatron_dapo.parallel import free_port as free_master_port

    tools = ["rollout.streaming=false", "rollout.tools.name=echo_tool:run", "rollout.tools.code_open=Answer: ",
             "rollout.tools.code_close=2", "rollout.tools.max_output_tokens=4", "algo.void_turn_filter=true",
             "logging.samples_every=1"]
    cmd = trainer_cmd(base_dir, tmp_path, "torchrun", f"rollout.sglang.base_port={server_ports()}",
                       "rollout.sglang.weight_sync=distributed", "rollout.colocate=false",
                       "eval.every_steps=0", *tools)
    assert cmd[1:3] == ["-m", "megatron_dapo.train"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
           str(free_master_port()), "-m", "megatron_dapo.train", *cmd[3:]]
    workers = os.path.join(os.path.dirname(__file__), "workers")
    env = {**python_env, "MEGATRON_DAPO_SGLANG_PYTHON": sglang_python,
           "PYTHONPATH": f"{workers}{os.pathsep}{python_env['PYTHONPATH']}"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    assert r.returncode == 0, r.stderr[-6000:]
    tb = read_scalars(tmp_path / "tb" / "torchrun")
    assert set(tb["perf/weight_sync_bytes"]) == {1, 2} and min(tb["perf/weight_sync_bytes"].values()) > 0
    assert sum(tb["tool/calls_per_sample"].values()) > 0 and max(tb["rollout/observation_token_frac"].values()) > 0
    assert tb["rollout/train_rollout_logprob_absdiff"][2] < 1e-4
    rows = [json.loads(line) for f in (tmp_path / "tb" / "torchrun" / "samples").glob("*.jsonl")
            for line in f.read_text().splitlines()]
    assert any("```output" in row["response"] for row in rows), rows[:2]


@pytest.mark.sglang
@SGLANG_TIMEOUT
def test_three_nodes_each_start_a_server_and_rank0_drives_all(sglang_python, base_dir, tmp_path, python_env):
    """Three trainer ranks posing as three nodes (GROUP_RANK 0, 1, 2): each node's leader starts its own
    server and updates it from its own copy of the weights (node-local, tensor transport); rank 0 drives all
    three for generation, nodes 1 and 2 attached. After each step's sync every server's logprobs equal the
    actor's (the prompts are split across all three); no weight byte crossed a node, and rank 0 sent one
    model (to its own server), not one per node. Node 2's server is SIGKILLed as it starts step 2's groups: rank
    0 sees its port refuse connections (mid-stream: the others generate its groups; or, if they were done, at the
    next phase change), node 2's rank restarts it at rank 0's request (it waits for the driver meanwhile), and it
    takes the weights from node 2's own rank at the step's sync."""
    import subprocess

    import psutil

    from megatron_dapo.metrics import read_scalars
    from megatron_dapo.parallel import free_port as free_master_port

    port = server_ports(3)
    cmd = trainer_cmd(base_dir, tmp_path, "nodes3", f"rollout.sglang.base_port={port}", "parallel.backend=gloo",
                      "train.prompt_batch_size=6", "train.mini_batch_size=3", "eval.every_steps=0",
                      "algo.dynamic_sampling=false", "rollout.sglang.health_timeout_s=20")
    master = str(free_master_port())
    procs = []
    for rank in range(3):
        env = {**python_env, "MEGATRON_DAPO_SGLANG_PYTHON": sglang_python, "RANK": str(rank), "WORLD_SIZE": "3",
               "LOCAL_RANK": "0", "GROUP_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master,
               "DAPO_NODE_ADDR": "127.0.0.1", "TMPDIR": str(tmp_path)}
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    log, pid, killed = tmp_path / "megatron-dapo-sglang" / f"sglang-127.0.0.1-{port + 2}.log", None, None
    outs = []
    try:
        deadline = time.monotonic() + 900
        while killed is None and all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            pid = pid or next((c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port + 2
                               and c.status == psutil.CONN_LISTEN), None)
            text = log.read_text(errors="replace") if log.is_file() else ""
            synced = text.find("POST /end_weight_update")  # step 1's sync is done: step 2 generates
            if pid and synced >= 0 and re.search(r"Prefill batch, #new-seq: [2-9]", text[synced:]):
                os.kill(killed := pid, signal.SIGKILL)
            time.sleep(0.01)
        for p in procs:
            outs.append(p.communicate(timeout=1200)[0])
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n=====\n".join(o[-5000:] for o in outs)
    assert killed is not None, "node 2's server never generated step 2's groups"
    line = next(x for x in outs[0].splitlines() if "SGLang servers:" in x)
    assert line.count("(attached)") == 2 and "from the node's own ranks (tensor)" in line, line
    assert f"rollout engine http://127.0.0.1:{port + 2}: refuses connections" in outs[0], outs[0][-5000:]
    tb = read_scalars(tmp_path / "tb" / "nodes3")
    assert tb["rollout/engine_restarts"] == {1: 0.0, 2: 1.0} and tb["rollout/groups_trained"] == {1: 6.0, 2: 6.0}
    assert max(tb["rollout/train_rollout_logprob_absdiff"].values()) < 1e-4
    assert max(tb["rollout/weight_sync_probe_absdiff"].values()) < 0.01  # the restarted one scored too
    model = tb["perf/weight_sync_bytes"]
    assert set(tb["perf/weight_sync_bytes_cross_node"].values()) == {0.0}
    assert all(0 < tb["perf/weight_sync_bytes_sent_rank0"][s] <= model[s] for s in model)


@pytest.mark.sglang
@SGLANG_TIMEOUT
def test_a_lone_server_killed_then_hung_mid_rounds_comes_back_with_the_current_weights(sglang_python, base_dir,
                                                                                       tmp_path, python_env):
    """One real server, rounds (no streaming): SIGKILLed while it generates step 1's groups, then, started again,
    SIGSTOPped while it generates step 2's (hung: its health check goes silent). Each time it is stopped for good
    and started again, takes the actor's current weights at once (nothing else generates; the probe checks
    them), generates its groups again from their seeds, and both steps train a full batch on logprobs equal to
    the actor's."""
    import subprocess

    import psutil

    from megatron_dapo.metrics import read_scalars

    port = server_ports(1)
    cmd = trainer_cmd(base_dir, tmp_path, "lone", "rollout.sglang.num_servers=1", f"rollout.sglang.base_port={port}",
                      "eval.every_steps=0", "algo.dynamic_sampling=false", "rollout.streaming=false",
                      "rollout.sglang.health_timeout_s=5")
    env = {**python_env, "MEGATRON_DAPO_SGLANG_PYTHON": sglang_python, "TMPDIR": str(tmp_path)}
    log = tmp_path / "megatron-dapo-sglang" / f"sglang-127.0.0.1-{port}.log"

    def listener():
        return next((c.pid for c in psutil.net_connections("tcp")
                     if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN), None)

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline, killed, stopped = time.monotonic() + 900, None, None
        while stopped is None and proc.poll() is None and time.monotonic() < deadline:
            text = log.read_text(errors="replace") if log.is_file() else ""
            batch = r"Prefill batch, #new-seq: [2-9]"  # not start-up's warm-up and health checks (one each)
            if killed is None and re.search(batch, text) and (killed := listener()):
                os.kill(killed, signal.SIGKILL)  # step 1's groups
            # the restarted server's log: the refresh's update, step 1's groups again, step 1's sync, step 2
            elif killed and len(parts := text.split("POST /end_weight_update")) >= 3 and re.search(batch, parts[2]) \
                    and (pid := listener()) not in (None, killed):
                stopped = pid
                os.kill(stopped, signal.SIGSTOP)  # hung: alive, answers nothing
            time.sleep(0.02)
        assert stopped is not None, f"the server was not killed in step 1 and stopped in step 2 ({killed})"
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-6000:]
    assert "exited with code -9; restarting it (restart 1 of at most 3" in err, err[-4000:]
    assert "did not answer its health check" in err and "restarting it (restart 2 of at most 3" in err, err[-4000:]
    tb = read_scalars(tmp_path / "tb" / "lone")
    assert tb["rollout/engine_restarts"] == {1: 1.0, 2: 2.0} and tb["rollout/resubmitted_groups"] == {1: 8.0, 2: 16.0}
    assert tb["rollout/groups_trained"] == {1: 8.0, 2: 8.0}, err[-6000:]
    assert max(tb["rollout/weight_sync_probe_absdiff"].values()) < 0.01
    assert max(tb["rollout/train_rollout_logprob_absdiff"].values()) < 1e-4  # from the current weights each time
