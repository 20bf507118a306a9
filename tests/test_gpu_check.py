"""The GPU check (tools/gpu_check.sh) before any GPU is lent: its dry run lists every stage and builds the
summary; its end-to-end stage (tools/gpu_tiny_run.py: the tiny DAPO job in bf16, colocated with offload,
a checkpoint after every step, the weight-sync probe on) runs here on the CPU, so bf16 is a CPU tier too."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import re
import subprocess
import sys
import tomllib
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


def calls_on(path: Path, names: dict[str, type]) -> list[tuple[int, type, str, int, list[str]]]:
    """Each call `var.method(...)` in a script whose `var` is in `names`: (line, class, method, positional
    count, keywords); calls with *args / **kwargs are left out."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        f = node.func if isinstance(node, ast.Call) else None
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in names:
            assert isinstance(node, ast.Call)
            if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
                continue
            found.append((node.lineno, names[f.value.id], f.attr, len(node.args), [k.arg for k in node.keywords]))
    return found


def test_the_gpu_workers_calls_bind_to_the_real_signatures():
    """The CUDA-only workers run nowhere here: every call they make on the actor, the engine and the phases
    must at least fit the methods' signatures (the type check, .ci/run, checks the types as well)."""
    from megatron_dapo.actor.actor import Actor
    from megatron_dapo.loop.phases import Phases
    from megatron_dapo.rollout.embedded import EmbeddedEngine

    workers: dict[str, dict[str, type]] = {
        "phases_gpu_worker.py": {"phases": Phases, "actor": Actor, "engine": EmbeddedEngine},
        "actor_gpu_worker.py": {"actor": Actor}}
    checked = 0
    for name, names in workers.items():
        for line, cls, method, npos, keywords in calls_on(REPO / "tests" / "workers" / name, names):
            sig = inspect.signature(getattr(cls, method))
            try:
                sig.bind(None, *[None] * npos, **dict.fromkeys(keywords))
            except TypeError as e:
                pytest.fail(f"{name}:{line}: {cls.__name__}.{method}{sig}: {e}")
            checked += 1
    assert checked >= 10
    # the calls the phases GPU test makes, as the signatures stand today (sync gained `step`)
    phases_calls = {(m, n) for _, _, m, n, _ in calls_on(REPO / "tests/workers/phases_gpu_worker.py",
                                                         {"phases": Phases})}
    assert ("sync", 1) in phases_calls


def test_bench_actors_naive_baseline_overrides_what_the_actor_calls():
    """tools/bench_actor.py's naive row (the memory baseline on CUDA) replaces one actor method: its
    parameters must be the actor's, or the actor's call fails and the row is missing."""
    from megatron_dapo.actor.actor import Actor

    spec = importlib.util.spec_from_file_location("bench_actor", REPO / "tools" / "bench_actor.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    naive = bench.naive_actor_class()
    overridden = [k for k, v in vars(naive).items() if callable(v) and hasattr(Actor, k)]
    assert overridden
    for name in overridden:
        mine, theirs = inspect.signature(getattr(naive, name)), inspect.signature(getattr(Actor, name))
        assert [(p.name, p.kind, p.default) for p in mine.parameters.values()] == \
            [(p.name, p.kind, p.default) for p in theirs.parameters.values()], name


def test_no_gpu_test_hides_its_script_in_a_string():
    """A script passed as `python -c STRING` is neither type checked nor seen by a CPU test: the GPU tests
    the check runs keep theirs in files (tests/workers/), and the type check reads tests/ and tools/."""
    stage = (REPO / "tools" / "gpu_check.sh").read_text().split("stage pytest", 1)[1].split("\nstage ", 1)[0]
    gpu_tests = re.findall(r"tests/test_\w+\.py", stage)
    assert "tests/test_phases_gpu.py" in gpu_tests and "tests/test_actor_gpu.py" in gpu_tests
    for test in gpu_tests:
        assert '"-c"' not in (REPO / test).read_text(), test
    assert "<<" not in (REPO / "tools" / "gpu_check.sh").read_text()  # no heredoc Python either
    mypy = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
    assert {"megatron_dapo", "tests", "tools"} <= set(mypy["files"]) and mypy["check_untyped_defs"] is True
