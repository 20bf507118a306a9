"""Training runs on real SGLang servers on CPU (`-m sglang`): an async trainer with a server of its own,
torchrun with the distributed weight transport and multi-turn tool rollouts, three nodes each starting one, two
servers, one of them killed mid-rollout and restarted while the run goes on, and a lone server hung mid-rounds and
restarted (issue 38). Split from test_rollout_sglang_servers.py so that the two long files run on two workers."""

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
    model (to its own server), not one per node."""
    import subprocess

    from megatron_dapo.metrics import read_scalars
    from megatron_dapo.parallel import free_port as free_master_port

    cmd = trainer_cmd(base_dir, tmp_path, "nodes3", f"rollout.sglang.base_port={server_ports(3)}",
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


@pytest.mark.sglang
@SGLANG_TIMEOUT
def test_a_server_killed_mid_rollout_is_restarted_and_the_run_trains_full_batches(sglang_python, base_dir,
                                                                                 tmp_path, python_env):
    """The DAPO loop on two real servers (colocated sleep/wake, weight sync to both after every step, their
    logprobs equal the actor's on the tokens they sampled), and one of them SIGKILLed while it generates (step 1
    or 2): its groups are generated by the other, it starts again on its port, takes the weights at the step's
    sync (the probe scores both servers), and both steps train a full batch (8 groups)."""
    import subprocess

    import psutil

    from megatron_dapo.metrics import read_scalars

    port = server_ports(2)
    # dynamic sampling off: every step streams exactly its 8 groups, so a group lost in the restart shows (with it
    # on, the session's 8 s base keeps ~20% of its groups and a step may spend its budget, restart or not)
    cmd = trainer_cmd(base_dir, tmp_path, "restart", "rollout.sglang.num_servers=2", f"rollout.sglang.base_port={port}",
                       "eval.every_steps=0", "algo.dynamic_sampling=false")
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
    assert "exited with code -9; restarting it (restart 1 of at most 3 this run)" in err, err[-4000:]
    tb = read_scalars(tmp_path / "tb" / "restart")
    assert tb["rollout/engine_restarts"][2] == 1 and tb["rollout/resubmitted_groups"][2] >= 1  # run totals
    assert tb["rollout/groups_trained"] == {1: 8.0, 2: 8.0}, err[-6000:]
    assert max(tb["rollout/weight_sync_probe_absdiff"].values()) < 0.01
    assert max(tb["rollout/train_rollout_logprob_absdiff"].values()) < 1e-4
    assert set(tb["perf/weight_sync_bytes"]) == {1, 2} and min(tb["perf/weight_sync_bytes"].values()) > 0



@pytest.mark.sglang
@SGLANG_TIMEOUT
def test_a_lone_server_hung_mid_rounds_comes_back_with_the_current_weights(sglang_python, base_dir, tmp_path,
                                                                           python_env):
    """One real server, rounds (no streaming), SIGSTOPped while it generates step 2's groups (after step 1's
    sync): its health check goes silent, it is stopped for good and started again, takes the actor's current
    weights at once (nothing else generates; the probe checks them), generates its groups again from their
    seeds, and both steps train a full batch on logprobs equal to the actor's."""
    import subprocess

    import psutil

    from megatron_dapo.metrics import read_scalars

    port = server_ports(1)
    cmd = trainer_cmd(base_dir, tmp_path, "lone", "rollout.sglang.num_servers=1", f"rollout.sglang.base_port={port}",
                      "eval.every_steps=0", "algo.dynamic_sampling=false", "rollout.streaming=false",
                      "rollout.sglang.health_timeout_s=5")
    env = {**python_env, "MEGATRON_DAPO_SGLANG_PYTHON": sglang_python, "TMPDIR": str(tmp_path)}
    log = tmp_path / "megatron-dapo-sglang" / f"sglang-127.0.0.1-{port}.log"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline, stopped = time.monotonic() + 600, None
        while stopped is None and proc.poll() is None and time.monotonic() < deadline:
            text = log.read_text(errors="replace") if log.is_file() else ""
            synced = text.find("POST /end_weight_update")  # step 1's sync is done: step 2 generates
            if synced >= 0 and re.search(r"Prefill batch, #new-seq: [2-9]", text[synced:]):
                stopped = next(c.pid for c in psutil.net_connections("tcp")
                               if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN)
                os.kill(stopped, signal.SIGSTOP)  # hung: alive, answers nothing
            time.sleep(0.02)
        assert stopped is not None, "the server never generated step 2's groups"
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-6000:]
    assert "did not answer its health check" in err and "restarting it (restart 1 of at most 3" in err, err[-4000:]
    tb = read_scalars(tmp_path / "tb" / "lone")
    assert tb["rollout/engine_restarts"] == {1: 0.0, 2: 1.0} and tb["rollout/resubmitted_groups"][2] == 8
    assert tb["rollout/groups_trained"] == {1: 8.0, 2: 8.0}, err[-6000:]
    assert max(tb["rollout/weight_sync_probe_absdiff"].values()) < 0.01
    assert max(tb["rollout/train_rollout_logprob_absdiff"].values()) < 1e-4  # step 2's from the current weights
