"""The GPU check (tools/gpu_check.sh) before any GPU is lent: its dry run lists every stage and builds the
summary; its end-to-end stage (tools/gpu_tiny_run.py: the tiny DAPO job in bf16, colocated with offload,
a checkpoint after every step, the weight-sync probe on) runs here on the CPU, so bf16 is a CPU tier too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_dry_run_lists_every_stage(tmp_path):
    r = subprocess.run(["bash", "tools/gpu_check.sh", "--dry-run"], cwd=REPO, capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "GPU_CHECK_OUT": str(tmp_path), "PYTHON": sys.executable},
                       timeout=120)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    stages = ["install", "cuda", "pytest", "bench_loss", "bench_actor", "bench_dynamic", "tiny_dapo"]
    assert summary["mode"] == "dry" and list(summary["stages"]) == stages
    assert all(v == "dry-run" for v in summary["stages"].values())
    assert "tools/gpu_tiny_run.py --out" in r.stderr
    limits = [int(line.split("(timeout ")[1].split("s)")[0]) for line in r.stderr.splitlines() if "(timeout " in line]
    assert len(limits) == len(stages) and sum(limits) <= 540  # the whole check within 9 minutes


@pytest.mark.slow
def test_the_tiny_job_runs_in_bf16_with_a_checkpoint_every_step(tmp_path, python_env):
    import torch

    from megatron_dapo.loop.weight_probe import TOLERANCE

    r = subprocess.run([sys.executable, "tools/gpu_tiny_run.py", "--out", str(tmp_path), "--steps", "2",
                        "--base-seconds", "5"], cwd=REPO, capture_output=True, text=True, env=python_env, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["rc"] == 0 and result["steps"] == [1, 2]
    probe = result["rollout/weight_sync_probe_absdiff"]
    assert sorted(probe) == ["1", "2"] and all(v < TOLERANCE[torch.bfloat16] for v in probe.values())
    assert all(v < 0.05 for v in result["rollout/train_rollout_logprob_absdiff"].values())
    assert result["ledger"]["memory/actor_asleep_in_generate"] == 1.0
    assert result["ledger"]["memory/engine_bytes_train"] == 0
    assert (tmp_path / "ckpt" / "gpu_tiny" / "hf_final" / "model.safetensors").is_file()
