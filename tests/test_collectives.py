"""Every collective a training step makes is one a CUDA run's backends accept.

On CPU every process group is gloo, which takes the CPU tensors the trainer's control messages use (the
rollout header, the leaders' all-gather, counts and flags); NCCL takes none, so with plain `nccl` a GPU run
with DP, TP or PP > 1 failed at its first step. Here a 2-rank step at DP2, TP2 and PP2 runs with every
collective recorded (tensor devices, group, the backend it was created with: tests/workers/collective_audit.py)
and the record is held against the group backends `parallel.backend_for` chooses on CUDA.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from workers.collective_audit import refused

from megatron_dapo import parallel
from megatron_dapo.config import ParallelConfig

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "workers" / "audit_worker.py"
STEP = ["train.prompt_batch_size=4", "train.mini_batch_size=2", "algo.group_size=4", "eval.every_steps=0",
        "data.val_path=", "checkpoint.save_every=0", "checkpoint.export_hf=false", "train.steps=1",
        "rollout.max_response_len=8", "reward.overlong_cache_len=6", "algo.filter_metric=score"]


def test_the_cuda_backend_serves_host_tensors_beside_nccl():
    auto = ParallelConfig()
    assert parallel.backend_for(auto, cuda=True) == "cpu:gloo,cuda:nccl"
    assert parallel.backend_for(ParallelConfig(backend="nccl"), cuda=True) == "cpu:gloo,cuda:nccl"
    assert parallel.backend_for(auto, cuda=False) == "gloo"


def test_the_audit_refuses_what_nccl_refuses():
    host = {"op": "broadcast", "devices": ["cpu"], "group": "default", "ranks": [0, 1]}
    device = {**host, "devices": ["cuda"]}
    assert refused([host], "nccl") == ["broadcast on ranks [0, 1] (default group -> {'cuda': 'nccl'}): a cpu tensor"]
    assert refused([device], "nccl") == []
    assert refused([host, device], "cpu:gloo,cuda:nccl") == []
    assert refused([{**host, "group": "gloo"}], "nccl") == []  # megatron's own gloo groups
    assert refused([{**host, "devices": ["cpu", "cuda"]}], "cpu:gloo,cuda:nccl")  # one call, two devices


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_a_full_step_makes_only_collectives_cuda_accepts(base_dir, tmp_path, python_env, layout):
    tp, pp = {"dp2": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}[layout]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(parallel.free_port()), str(WORKER), "--config", str(REPO / "examples/configs/tiny_cpu.yaml"),
           f"model.hf_dir={base_dir}", f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.tensorboard_dir={tmp_path}",
           f"parallel.tensor_parallel={tp}", f"parallel.pipeline_parallel={pp}", *STEP]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**python_env, "DAPO_AUDIT_OUT": str(tmp_path)},
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    records = [rec for rank in (0, 1) for rec in json.loads((tmp_path / f"rank_{rank}.json").read_text())]
    ops = {rec["op"] for rec in records}
    assert {"broadcast", "all_reduce", "all_gather"} <= ops, ops  # the step really communicated
    cuda_backend = parallel.backend_for(ParallelConfig(), cuda=True)
    assert not (bad := refused(records, cuda_backend)), "\n".join(bad)


def test_every_rank_validates_when_only_the_driver_holds_the_validation_set(base_dir, tmp_path, python_env):
    """The validation prompts live on the driver; validating moves the devices collectively (a barrier per
    phase), so every rank must agree to validate: TP2 with validation at steps 0 and 1 completes (the other
    rank skipped step 0's validation and the two ranks' barriers crossed: a hang)."""
    from megatron_dapo.metrics import read_scalars

    steps = [a for a in STEP if not a.startswith(("eval.every_steps", "data.val_path"))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(parallel.free_port()), "-m", "megatron_dapo.train", "--config", str(REPO / "examples/configs/tiny_cpu.yaml"),
           f"model.hf_dir={base_dir}", f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.tensorboard_dir={tmp_path}",
           "logging.run_name=val", "parallel.tensor_parallel=2", *steps, "eval.every_steps=1", "eval.max_prompts=4",
           "eval.n_samples=2"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=python_env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    assert set(read_scalars(tmp_path / "val")["val/acc_avg_at_k"]) == {0, 1}


@pytest.mark.slow
def test_a_rollout_longer_than_the_collective_timeout_completes(base_dir, tmp_path, python_env):
    """parallel.timeout_s=20 and a first rollout that takes over 35 s (its first reward call sleeps): rank 1
    waits for the driver on the rendezvous store, not in the header's broadcast (which timed out: gloo
    "Timed out waiting 20000ms"; NCCL's watchdog would have killed a GPU job the same way). The driver is slow,
    not hung: its heartbeat goes on, and a 10 s parallel.driver_heartbeat_timeout_s does not stop rank 1."""
    from megatron_dapo.metrics import read_scalars

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(parallel.free_port()), str(REPO / "tests" / "workers" / "train_worker.py"),
           "--config", str(REPO / "examples/configs/tiny_cpu.yaml"), f"model.hf_dir={base_dir}",
           f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.tensorboard_dir={tmp_path}", "logging.run_name=slow",
           *STEP, "parallel.timeout_s=20", "parallel.driver_heartbeat_timeout_s=10",
           "reward.name=slow_reward:slow_once", "reward.timeout_s=0"]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**python_env, "DAPO_TEST_REWARD_DELAY": "35"},
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    assert read_scalars(tmp_path / "slow")["timing/step_s"][1] > 35
