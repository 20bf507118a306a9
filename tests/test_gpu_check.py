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


def dry_run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "tools/gpu_check.sh", "--dry-run"], cwd=REPO, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
                               "GPU_CHECK_LOGS": str(tmp_path / "logs"), **env}, timeout=120)


def test_the_dry_run_lists_every_stage_and_leaves_few_files_in_out(tmp_path):
    r = dry_run(tmp_path)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    stages = ["install", "cuda", "pytest", "tiny_dapo", "bench_actor", "bench_loss", "bench_dynamic"]
    assert summary["mode"] == "dry" and list(summary["stages"]) == stages
    assert all(v == "dry-run" for v in summary["stages"].values())
    assert f"tools/gpu_tiny_run.py --out {tmp_path / 'logs'}" in r.stderr  # its run tree stays out of $OUT
    limits = [int(line.split("(timeout ")[1].split("s)")[0]) for line in r.stderr.splitlines() if "(timeout " in line]
    assert len(limits) == len(stages) and max(limits) <= 450 - 15
    # the device tool returns at most 8 files, no more than 2 folders down
    files = [p.relative_to(tmp_path / "out") for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert sorted(map(str, files)) == ["summary.json", "summary.txt"]
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == summary
    assert "pytest" in (tmp_path / "out" / "summary.txt").read_text()


def test_no_stage_outlives_the_budget(tmp_path):
    r = dry_run(tmp_path, GPU_CHECK_BUDGET="45")  # a dry stage takes no time: each may have 45 - 15 s
    limits = [int(line.split("(timeout ")[1].split("s)")[0]) for line in r.stderr.splitlines() if "(timeout " in line]
    assert limits == [30] * 7
    r = dry_run(tmp_path, GPU_CHECK_BUDGET="30")  # 15 s left: under the 20 a stage needs
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(summary["stages"].values()) == {"skipped: budget"}
    r = dry_run(tmp_path, GPU_CHECK_STAGES="pytest")
    stages = json.loads(r.stdout.strip().splitlines()[-1])["stages"]
    assert [k for k, v in stages.items() if v == "dry-run"] == ["install", "cuda", "pytest"]
    assert stages["tiny_dapo"] == "skipped: not selected"


def test_the_summary_carries_each_verdict_and_a_failing_stage_tail(tmp_path):
    logs, out = tmp_path / "logs", tmp_path / "out"
    logs.mkdir()
    stage_files = {"install": ("0", "3", "ok\n"), "cuda": ("0", "12", "2.13.0 NVIDIA H200 0.16.1\n"),
                   "pytest": ("1", "95", "".join(f"line {i}\n" for i in range(100)) + "1 failed, 24 passed in 90s\n"),
                   "tiny_dapo": ("124", "150", "stuck\n"),
                   "bench_actor": ("0", "40", '{"impl": "naive", "peak_loss_bytes": 100, "step_s": 2.0}\n'
                                   '{"impl": "linear", "peak_loss_bytes": 25, "step_s": 1.0}\n')}
    for name, (rc, secs, log) in stage_files.items():
        (logs / f"{name}.rc").write_text(rc + "\n")
        (logs / f"{name}.s").write_text(secs + "\n")
        (logs / f"{name}.log").write_text(log)
    r = subprocess.run(["bash", "tools/gpu_check.sh", "--summary", str(logs)], cwd=REPO, capture_output=True,
                       text=True, env={"PATH": "/usr/bin:/bin", "GPU_CHECK_OUT": str(out), "PYTHON": sys.executable},
                       timeout=60)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["stages"] == {"install": "ok", "cuda": "ok", "pytest": "failed (rc 1)", "tiny_dapo": "timeout",
                                 "bench_actor": "ok", "bench_loss": "not run", "bench_dynamic": "not run"}
    assert summary["stage_seconds"]["pytest"] == 95 and summary["pytest"] == {"failed": 1, "passed": 24}
    assert summary["actor_vs_naive"] == {"linear": {"peak": 0.25, "step_time": 0.5}}
    assert sorted(summary["tails"]) == ["pytest", "tiny_dapo"]  # failing stages only
    tail = summary["tails"]["pytest"].splitlines()
    assert tail[0] == "line 61" and tail[-1] == "1 failed, 24 passed in 90s"  # the last 40 lines
    text = (out / "summary.txt").read_text()
    assert "1 failed, 24 passed in 90s" in text and "stuck" in text and "line 60" not in text
    assert text.strip() in r.stdout and sorted(p.name for p in out.iterdir()) == ["summary.json", "summary.txt"]


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
