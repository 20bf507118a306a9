"""The Slurm launcher (examples/launch_common.sh, run_dapo_32b.sh, run_dapo_tiny.sh).

Default tier (no Slurm needed): the scripts parse; the 32B script's DRY_RUN mode prints the sbatch /
srun commands (every task seeing its node's GPUs) and runs the planner and the trainer's --dry-run, also in its
FIRST_CONTACT mode; a layout the planner refuses is never
submitted (a stub `sbatch` records calls); the tiny script runs locally by default and, inside an
allocation, validates with 2 ranks.

`-m slurm` (a real local Slurm: `bash tools/slurm_local.sh up`, or .ci/slurm_tier.sh): the tiny job
goes through sbatch with 2 tasks (2 ranks, gloo); the test polls `squeue` every second and checks the
exit code (`scontrol show job`), the log and the TensorBoard events; a second job whose trainer
exits 2 is reported FAILED with exit code 2; a job sent the time-limit warning (SIGUSR1) saves its
step, is requeued and resumes from that checkpoint to the end.
"""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = ["examples/run_dapo_32b.sh", "examples/run_dapo_tiny.sh", "examples/launch_common.sh",
           "tools/slurm_local.sh", ".ci/slurm_tier.sh"]
FAST = ["train.steps=2", "eval.every_steps=0", "train.prompt_batch_size=8", "train.mini_batch_size=4",
        "algo.group_size=4", "algo.dynamic_sampling=false", "checkpoint.export_hf=false"]


def script_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PYTHON=sys.executable, PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def bash(script, *args, env=None, timeout=300, cwd=REPO):
    return subprocess.run(["bash", str(REPO / script), *args], capture_output=True, text=True,
                          env=env or script_env(), timeout=timeout, cwd=cwd)


# ------------------------------------------------------------------------------- default tier


@pytest.mark.parametrize("path", SCRIPTS)
def test_scripts_parse(path):
    assert (REPO / path).is_file(), path
    r = subprocess.run(["bash", "-n", str(REPO / path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory) -> dict:
    """The 32B launcher's model and datasets, tiny (the trainer's --dry-run refuses missing ones), as the
    launcher's variables."""
    from support import stand_in_32b

    root = stand_in_32b(tmp_path_factory.mktemp("stand_in"))
    data = root / "data"
    return {"HF_DIR": str(root / "models" / "Qwen2.5-32B"), "TRAIN_DATA": str(data / "dapo-math-17k.parquet"),
            "VAL_DATA": str(data / "aime-2024.parquet")}


def test_32b_dry_run_prints_commands_and_plans(stand_in, tmp_path):
    r = bash("examples/run_dapo_32b.sh", env=script_env(DRY_RUN="1", **stand_in), cwd=tmp_path)  # from anywhere
    out = r.stdout
    assert r.returncode == 0, out[-3000:] + r.stderr[-3000:]
    sbatch = next(line for line in out.splitlines() if line.strip().startswith("sbatch "))
    for flag in ("--parsable", "--nodes=16", "--ntasks-per-node=8", "--gpus-per-node=8", "--requeue",
                 "--job-name=dapo-qwen2.5-32b", "--time=48:00:00", "examples/run_dapo_32b.sh"):
        assert flag in sbatch, (flag, sbatch)
    srun = next(ln for ln in out.splitlines() if "megatron_dapo.train --config" in ln and "srun" in ln)
    for part in ("--kill-on-bad-exit=1", "--ntasks=128", "--gpus-per-node=8", "--gpu-bind=none",
                 "parallel.tensor_parallel=8",
                 "rollout.engine=sglang", "rollout.sglang.tensor_parallel=4", "checkpoint.resume=auto",
                 "train.mini_batch_size=32", "model.load=checkpoints/Qwen2.5-32B-megatron",
                 "algo.eps_high=0.28"):
        assert part in srun, (part, srun)
    assert f"tools/convert_hf_to_megatron.py --hf-dir {stand_in['HF_DIR']}" in out
    assert "MASTER_ADDR=$(scontrol show hostnames" in out and "CUDA_DEVICE_MAX_CONNECTIONS=1" in out
    assert "TP=8 x PP=1 x DP=16" in out and "verdict: FITS" in out  # the planner ran
    assert "--world-size 128 --dry-run" in out and "tensor_parallel: 8" in out  # the trainer's check ran
    assert "mini_batch_size: 32" in out


def test_32b_first_contact_is_short_checks_every_phase_and_summarises_them(stand_in, tmp_path):
    """FIRST_CONTACT=1: the real layout for a few short steps (an evaluation, saves, the probe), its own run name and
    hour, and the phase summary after the trainer; the trainer's --dry-run accepts the overrides at 8 x 8 ranks."""
    r = bash("examples/run_dapo_32b.sh", "--nodes", "8", env=script_env(DRY_RUN="1", FIRST_CONTACT="1", PLAN="0", **stand_in),
             cwd=tmp_path)  # the command the README gives (On a GPU)
    out = r.stdout
    assert r.returncode == 0, out[-3000:] + r.stderr[-3000:]
    sbatch = next(line for line in out.splitlines() if line.strip().startswith("sbatch "))
    assert "--time=01:00:00" in sbatch and "--job-name=dapo-32b-first-contact" in sbatch and "--nodes=8" in sbatch
    srun = next(ln for ln in out.splitlines() if "megatron_dapo.train --config" in ln and "srun" in ln)
    for part in ("train.steps=3", "rollout.max_response_len=2048", "eval.every_steps=3", "checkpoint.save_every=2",
                 "rollout.weight_sync_probe=true", "logging.run_name=dapo_qwen2.5_32b_first_contact"):
        assert part in srun, (part, srun)
    assert ("megatron_dapo.metrics.phase_summary --logdir runs/dapo_qwen2.5_32b_first_contact --checkpoints "
            "checkpoints/dapo_qwen2.5_32b_first_contact") in out
    config = out[out.index("--world-size 64 --dry-run"):]
    assert "  steps: 3\n" in config and "  max_response_len: 2048\n" in config


def test_32b_dry_run_flags_override_the_header(stand_in):
    r = bash("examples/run_dapo_32b.sh", "--nodes", "2", "--time=1:00:00", "--dry-run",
             "algo.eps_high=0.3", env=script_env(GPU_MEM_GB="141", PARTITION="gpu", **stand_in))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "--nodes=2 " in r.stdout and "--time=1:00:00" in r.stdout and "--partition=gpu" in r.stdout
    assert "--ntasks=16" in r.stdout and "algo.eps_high=0.3" in r.stdout and "verdict: FITS" in r.stdout


@pytest.fixture
def stub_sbatch(tmp_path):
    """A fake `sbatch` first on PATH that records its arguments and answers a job id."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls = tmp_path / "sbatch_calls"
    (bindir / "sbatch").write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho 4242\n')
    (bindir / "sbatch").chmod(0o755)
    ckpt = tmp_path / "megatron_ckpt"  # a "converted" checkpoint, so the weights check passes
    ckpt.mkdir()
    (ckpt / "COMPLETE").write_text("0")
    env = script_env(PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}", MEGATRON_CKPT=str(ckpt),
                     LOG_DIR=str(tmp_path / "logs"))
    return env, calls


def test_32b_refused_layout_is_not_submitted(stub_sbatch):
    env, calls = stub_sbatch
    r = bash("examples/run_dapo_32b.sh", env={**env, "NODES": "1"})
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "verdict: REFUSED" in r.stdout and "not submitted" in r.stdout
    assert not calls.exists()


def test_32b_submits_itself(stub_sbatch):
    env, calls = stub_sbatch
    r = bash("examples/run_dapo_32b.sh", "train.steps=3", env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "4242"
    assert "submitted job 4242" in r.stdout
    args = calls.read_text()
    assert "--parsable" in args and "--nodes=16" in args and "run_dapo_32b.sh train.steps=3" in args
    assert (Path(env["LOG_DIR"])).is_dir()  # Slurm does not create the log folder itself


def test_32b_without_weights_is_not_submitted(stub_sbatch):
    env, calls = stub_sbatch
    r = bash("examples/run_dapo_32b.sh", env={**env, "MEGATRON_CKPT": "/nowhere", "HF_DIR": "/nowhere/hf"})
    assert r.returncode == 2 and "Qwen/Qwen2.5-32B" in r.stderr
    assert not calls.exists()


def test_tiny_runs_locally_by_default_and_passes_status():
    r = bash("examples/run_dapo_tiny.sh", "algo.eps_hgh=0.3")  # config error: exit 2, nothing built
    assert r.returncode == 2 and "eps_high" in r.stderr


def test_slurm_launch_without_slurm_is_our_one_line(tmp_path):
    """No sbatch on PATH: our error first (no raw `sbatch: command not found`), nothing built or submitted."""
    shadow = tmp_path / "bin"  # the PATH's programs but sbatch (dropping its folder, /usr/bin, drops bash too)
    shadow.mkdir()
    for d in os.environ["PATH"].split(os.pathsep):  # the first folder of a name wins, as on the PATH
        for exe in Path(d).glob("*") if Path(d).is_dir() else ():
            if exe.name != "sbatch" and not (shadow / exe.name).exists():
                (shadow / exe.name).symlink_to(exe)
    r = bash("examples/run_dapo_tiny.sh", env=script_env(LAUNCH="slurm", PATH=str(shadow), LOG_DIR=str(tmp_path)))
    assert r.returncode == 2 and r.stderr.splitlines()[0].startswith("[launch] error: no sbatch"), r.stderr
    assert "LAUNCH=local" in r.stderr and "command not found" not in r.stderr


def test_both_launchers_ask_for_the_preemption_signal():
    for script in ("examples/run_dapo_tiny.sh", "examples/run_dapo_32b.sh"):
        assert re.search(r"^#SBATCH --signal=B:USR1@\d+$", (REPO / script).read_text(), re.M), script
    common = (REPO / "examples/launch_common.sh").read_text()
    assert 'kill -USR1 "$pid"' in common and 'scontrol requeue "$SLURM_JOB_ID"' in common


def test_tiny_inside_an_allocation_uses_srun_with_two_ranks(base_dir):
    env = script_env(SLURM_JOB_ID="77", SLURM_NTASKS="2", SLURM_JOB_NUM_NODES="1", DRY_RUN="1")
    r = bash("examples/run_dapo_tiny.sh", *FAST, f"model.hf_dir={base_dir}", env=env)  # --dry-run reads it
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "srun --kill-on-bad-exit=1 --label --nodes=1 --ntasks-per-node=2 --ntasks=2" in r.stdout
    assert "parallel.backend=gloo" in r.stdout and "train.steps=2" in r.stdout
    assert "--world-size 2 --dry-run" in r.stdout  # validated with DP=2


# --------------------------------------------------------------------------------- slurm tier


def _slurm_or_skip():
    why = None
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        why = "sinfo/sbatch not found: bring a local Slurm up with `bash tools/slurm_local.sh up`"
    else:
        r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
        states = r.stdout.split()
        if r.returncode != 0:
            why = f"Slurm is not reachable (sinfo: {r.stderr.strip()[:200]})"
        elif not any(s.rstrip("*~#") in ("idle", "mixed", "allocated", "completing") for s in states):
            why = f"no usable Slurm node (sinfo states: {states})"
    if why:
        if os.environ.get("DAPO_REQUIRE_SLURM") == "1":
            pytest.fail(why)
        pytest.skip(why)


def wait_for(jobs: list[str], timeout: float = 900) -> dict[str, dict]:
    """Poll `squeue -j` every second until every job has left the queue; then scontrol's view."""
    deadline, pending = time.monotonic() + timeout, set(jobs)
    while pending:
        if time.monotonic() > deadline:
            subprocess.run(["scancel", *pending])
            pytest.fail(f"jobs {sorted(pending)} still queued after {timeout:.0f} s")
        for job in list(pending):
            r = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True)
            state = r.stdout.strip()
            if r.returncode != 0 or not state or state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                            "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL"):
                pending.discard(job)
        if pending:
            time.sleep(1)
    return {job: job_info(job) for job in jobs}


def job_info(job: str) -> dict:
    text = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    state = re.search(r"JobState=(\w+)", text)
    code = re.search(r"ExitCode=(\d+):(\d+)", text)
    return {"state": state and state.group(1), "exit": code and int(code.group(1)),
            "signal": code and int(code.group(2)), "text": text}


@pytest.fixture(scope="module")
def slurm_jobs(tmp_path_factory):
    """Submit a good and a failing tiny job at once (Slurm runs them one after the other); wait."""
    _slurm_or_skip()
    tmp = tmp_path_factory.mktemp("slurm")
    base = REPO / "checkpoints" / "tiny_base"
    if not (base / "base_info.json").is_file():  # CI's first command builds it; else a quick one
        from megatron_dapo.tiny import ensure_tiny_base

        base = ensure_tiny_base(tmp / "tiny_base", seconds=5)
    t0 = time.monotonic()
    # 1. the users' path: the script submits itself (sbatch --parsable) and prints the job id
    good = bash("examples/run_dapo_tiny.sh", "--output", str(tmp / "%x-%j.out"), f"model.hf_dir={base}",
                f"checkpoint.dir={tmp / 'ckpt'}", f"logging.tensorboard_dir={tmp / 'tb'}",
                "logging.run_name=slurm_tiny", *FAST, env=script_env(LAUNCH="slurm"), timeout=120)
    assert good.returncode == 0, good.stdout + good.stderr
    good_id = good.stdout.strip().splitlines()[-1]
    # 2. sbatch on the script itself (its #SBATCH header: 2 tasks); the trainer exits 2 on both ranks
    bad = subprocess.run(["sbatch", "--parsable", f"--output={tmp / 'bad-%j.out'}",
                          "examples/run_dapo_tiny.sh", "model.hf_dir=/nonexistent/tiny_base",
                          f"checkpoint.dir={tmp / 'ckpt'}", f"logging.tensorboard_dir={tmp / 'tb'}",
                          "logging.run_name=slurm_bad", *FAST],
                         capture_output=True, text=True, cwd=REPO, env=script_env(), timeout=120)
    assert bad.returncode == 0, bad.stderr
    bad_id = bad.stdout.strip().split(";")[0]
    info = wait_for([good_id, bad_id])
    run_times = {j: re.search(r"RunTime=(\S+)", info[j]["text"]) for j in (good_id, bad_id)}
    print(f"slurm jobs {good_id} (ok) + {bad_id} (fails) done in {time.monotonic() - t0:.1f} s; "
          + ", ".join(f"job {j} RunTime {m.group(1) if m else '?'}" for j, m in run_times.items()))
    return {"tmp": tmp, "good": (good_id, info[good_id]), "bad": (bad_id, info[bad_id]),
            "submit": good.stdout}


@pytest.mark.slurm
def test_tiny_job_through_slurm_succeeds(slurm_jobs):
    tmp = slurm_jobs["tmp"]
    job, info = slurm_jobs["good"]
    log_path = tmp / f"dapo-tiny-{job}.out"
    log = job_log(log_path) if log_path.is_file() else "(no log)"
    assert info["state"] == "COMPLETED" and info["exit"] == 0, info["text"] + log[-4000:]
    assert f"submitted job {job}" in slurm_jobs["submit"]
    assert "NumTasks=2" in info["text"]
    assert "1 node(s) x 2 tasks" in log and "MASTER_ADDR=" in log and "MASTER_PORT=" in log
    assert "srun --kill-on-bad-exit=1" in log and "[launch] trainer exited with status 0" in log
    assert re.search(r"^0: .*dapo", log, re.M), log[-3000:]  # rank-labelled trainer output

    from megatron_dapo.metrics import read_scalars

    assert any((tmp / "tb" / "slurm_tiny").glob("events.out.tfevents.*")), f"no TensorBoard events in {tmp}"
    scalars = read_scalars(tmp / "tb" / "slurm_tiny")
    for tag in ("train/reward_mean", "response_length/mean", "timing/step_s"):
        assert set(scalars.get(tag, {})) == {1, 2}, (tag, scalars.get(tag))


@pytest.mark.slurm
def test_failing_job_is_reported_failed(slurm_jobs):
    tmp = slurm_jobs["tmp"]
    job, info = slurm_jobs["bad"]
    log = job_log(tmp / f"bad-{job}.out")
    # Every rank exits 2 on the bad config; srun reports the highest code of its tasks, and a rank
    # still running when --kill-on-bad-exit fires is SIGTERMed (128 + 15), so the job may read 143.
    assert info["state"] == "FAILED" and info["exit"] in (2, 143), info["text"] + log[-3000:]
    assert "has no config.json" in log, log[-3000:]
    assert re.search(rf"\[launch\] trainer exited with status {info['exit']}$", log, re.M), log[-3000:]


# Enough steps that USR1, sent once step 1 shows in TensorBoard, lands before the last one even when a
# tiny step takes a third of a second (CI saw step 4 finish first with 4 steps).
PREEMPT_STEPS = 30


@pytest.mark.slurm
def test_usr1_before_the_time_limit_saves_requeues_and_resumes(tmp_path):
    """`#SBATCH --signal=B:USR1@120` as the time limit nears (sent here with `scancel --signal=USR1 --batch`
    once step 1 is logged): the launcher passes it to both ranks, they finish the step, save it and exit;
    the launcher requeues the job, which resumes from that checkpoint and completes every step."""
    _slurm_or_skip()
    base = REPO / "checkpoints" / "tiny_base"
    if not (base / "base_info.json").is_file():
        from megatron_dapo.tiny import ensure_tiny_base

        base = ensure_tiny_base(tmp_path / "tiny_base", seconds=5)
    r = bash("examples/run_dapo_tiny.sh", "--output", str(tmp_path / "%x-%j.out"), f"model.hf_dir={base}",
             f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.tensorboard_dir={tmp_path / 'tb'}",
             "logging.run_name=slurm_preempt", *FAST, f"train.steps={PREEMPT_STEPS}", "checkpoint.save_every=0",
             env=script_env(LAUNCH="slurm"), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    job = r.stdout.strip().splitlines()[-1]
    log_path = tmp_path / f"dapo-tiny-{job}.out"
    deadline = time.monotonic() + 600
    while _logged_steps(tmp_path / "tb" / "slurm_preempt") < {1} and time.monotonic() < deadline:
        time.sleep(1)
    assert _logged_steps(tmp_path / "tb" / "slurm_preempt") >= {1}, job_log(log_path)[-4000:]
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, timeout=30)
    info = wait_for([job], timeout=900)[job]
    log = job_log(log_path)
    assert info["state"] == "COMPLETED" and info["exit"] == 0, info["text"] + log[-5000:]
    saved = re.search(r"preempted: stopped by SIGUSR1 after step (\d+): checkpoint \S+step_0*(\d+)", log)
    assert saved and saved.group(1) == saved.group(2) and int(saved.group(1)) < PREEMPT_STEPS, log[-5000:]
    for needle in ("SIGUSR1 (time limit near)", f"requeueing job {job}", "(restart 1)",
                   f"resumed from {tmp_path / 'ckpt' / 'slurm_preempt'}/step_{int(saved.group(1)):08d}"):
        assert needle in log, (needle, log[-5000:])
    assert "Traceback" not in log, log[-5000:]
    assert _logged_steps(tmp_path / "tb" / "slurm_preempt") == set(range(1, PREEMPT_STEPS + 1))


def job_log(path: Path) -> str:
    """A job's output file. srun relays both ranks' progress bars into it, and can cut a multi-byte
    character between them (CI read invalid UTF-8), so undecodable bytes become U+FFFD."""
    return path.read_text(errors="replace")


def _logged_steps(logdir: Path) -> set[int]:
    from megatron_dapo.metrics import read_scalars

    try:
        return set(read_scalars(logdir, ["train/reward_mean"]).get("train/reward_mean", {}))
    except Exception:  # noqa: BLE001 - a file being written
        return set()
