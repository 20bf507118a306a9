"""Run folders, checkpoints, signals and start-up errors end to end, through `python -m megatron_dapo.train`
on the tiny base (CPU):

- a run owns its folder: reusing a run name is refused (one line, exit 2) unless checkpoint.overwrite;
  resume=auto with another config warns loudly; a second run is locked out, a stale lock taken over;
- a corrupt newest checkpoint is skipped (named, with the reason) and the run replays exactly from the
  one before it;
- SIGTERM or SIGUSR1 to every process of the job (as Slurm sends them) is acknowledged in the log, finishes the
  step, saves it and exits 128 + the signal (the helpers the trainer started survive it); resume=auto then
  replays the uninterrupted run;
- Ctrl-C exits 130 with one line and the last complete checkpoint intact;
- an unwritable or full checkpoint folder and a broken model folder are one line and exit 2 at start;
- a single-node run's TCP store listens on loopback only.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support import TAGS, logged_steps, one_line, run, signal_job, train_cmd, wait_for

from megatron_dapo.metrics import read_scalars

STEPS = ["train.steps=3", "eval.every_steps=0"]
COMPARED = [t for t in TAGS if not t.startswith(("timing/", "perf/", "val/"))]


@pytest.fixture(scope="module")
def straight(base_dir, tmp_path_factory, env):
    """The uninterrupted reference: 3 steps, a checkpoint after each."""
    root = tmp_path_factory.mktemp("straight")
    r = run(train_cmd(base_dir, root, "straight", *STEPS, "checkpoint.save_every=1"), env)
    assert r.returncode == 0, r.stderr[-5000:]
    return root


def assert_replays(straight_root: Path, root: Path, run_name: str, steps) -> None:
    a, b = read_scalars(straight_root / "tb" / "straight"), read_scalars(root / "tb" / run_name)
    for tag in COMPARED:
        for step in steps:
            assert a[tag][step] == b[tag][step], (tag, step, a[tag][step], b[tag][step])


def folder_of(root: Path, name: str) -> Path:
    return root / "ckpt" / name


# ------------------------------------------------------------------------------- run ownership


@pytest.mark.slow
def test_reusing_a_run_name_is_refused_unless_overwrite(base_dir, straight, tmp_path, env):
    root = tmp_path
    shutil.copytree(folder_of(straight, "straight"), folder_of(root, "mine"))
    before = sorted(p.name for p in folder_of(root, "mine").iterdir())
    r = run(train_cmd(base_dir, root, "mine", *STEPS, "checkpoint.resume=none", "train.seed=5"), env)
    one_line(r, 2, "holds another run's checkpoints", "checkpoint.overwrite=true")
    assert sorted(p.name for p in folder_of(root, "mine").iterdir()) == before  # nothing deleted
    r = run(train_cmd(base_dir, root, "mine", "train.steps=1", "eval.every_steps=0", "checkpoint.resume=none",
                      "train.seed=5", "checkpoint.overwrite=true", "checkpoint.export_hf=false"), env)
    assert r.returncode == 0, r.stderr[-4000:]
    assert sorted(p.name for p in folder_of(root, "mine").iterdir()) == ["step_00000001"]
    state = json.loads((folder_of(root, "mine") / "step_00000001" / "trainer_state.json").read_text())
    assert state["trainer"]["config"]["train"]["seed"] == 5


@pytest.mark.slow
def test_resume_auto_with_another_config_warns_loudly(base_dir, straight, tmp_path, env):
    shutil.copytree(folder_of(straight, "straight"), folder_of(tmp_path, "other"))
    shutil.rmtree(folder_of(tmp_path, "other") / "step_00000003")  # a finished run has nothing to train: resume at 2
    r = run(train_cmd(base_dir, tmp_path, "other", *STEPS, "train.seed=2", "checkpoint.export_hf=false"), env)
    assert r.returncode == 0, r.stderr[-4000:]
    warning = [ln for ln in r.stderr.splitlines() if "DIFFERENT CONFIG" in ln]
    assert warning and "train.seed: 1 -> 2" in warning[0] and "WARNING" in warning[0], r.stderr[-3000:]


@pytest.mark.slow
def test_a_second_run_is_locked_out_and_a_stale_lock_taken_over(base_dir, tmp_path, env):
    folder = folder_of(tmp_path, "locked")
    folder.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        start = Path(f"/proc/{holder.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        (folder / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid,
                                                  "pid_start": start, "since": "earlier"}))
        r = run(train_cmd(base_dir, tmp_path, "locked", *STEPS), env)
        one_line(r, 2, "is in use by pid", str(holder.pid))
    finally:
        holder.kill()
        holder.wait()
    r = run(train_cmd(base_dir, tmp_path, "locked", "train.steps=1", "eval.every_steps=0",
                      "checkpoint.export_hf=false"), env)
    assert r.returncode == 0, r.stderr[-4000:]
    assert f"pid {holder.pid} on this host is gone" in r.stderr and "stale lock" in r.stderr
    assert not (folder / ".lock").exists()  # released at the end


# ------------------------------------------------------------------------- verified checkpoints


@pytest.mark.slow
def test_a_corrupt_newest_checkpoint_is_skipped_and_the_run_replays_exactly(base_dir, straight, tmp_path, env):
    folder = folder_of(tmp_path, "copy")
    shutil.copytree(folder_of(straight, "straight"), folder)
    shard = sorted((folder / "step_00000003").glob("__*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated
    r = run(train_cmd(base_dir, tmp_path, "copy", *STEPS, "checkpoint.save_every=1"), env)
    assert r.returncode == 0, r.stderr[-5000:]
    assert f"checkpoint step_00000003 skipped: {shard.name} has" in r.stderr, r.stderr[-3000:]
    assert "resumed from" in r.stderr and "step_00000002" in r.stderr
    assert (folder / "step_00000003.corrupt").is_dir() and (folder / "step_00000003" / "COMPLETE").is_file()
    assert_replays(straight, tmp_path, "copy", [3])


# ------------------------------------------------------------------------ signals and Ctrl-C


def preempt_and_resume(base_dir, straight, tmp_path, env, sig: int, save_every: int) -> list[str]:
    """Signal the whole job (signal_job) once step 1 is logged (with `save_every`, once its checkpoint is
    complete: multiprocessing's resource tracker is alive then): the step in flight is finished and saved, one
    line names the signal, exit 128 + sig; resume=auto then replays the uninterrupted run. Returns what
    else was signalled."""
    cmd = train_cmd(base_dir, tmp_path, "term", *STEPS, f"checkpoint.save_every={save_every}")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    marker = folder_of(tmp_path, "term") / "step_00000001" / "COMPLETE"
    wait_for(lambda: 1 in logged_steps(tmp_path / "tb" / "term") and (not save_every or marker.exists()), proc)
    helpers = signal_job(proc, sig)
    _, stderr = proc.communicate(timeout=400)
    r = subprocess.CompletedProcess(cmd, proc.returncode, "", stderr)
    line = one_line(r, 128 + sig, f"train: preempted: stopped by {signal.Signals(sig).name} after step")
    step = int(line.split("after step ")[1].split(":")[0])
    # the step in flight was finished and the run stopped there (a step takes a fraction of a second here,
    # so the signal, sent once step 1 is on disk, may land in any of the 3 steps)
    assert step in (1, 2, 3), line
    # acknowledged when it arrived, in the log, naming the step it let finish (test_stop_ack.py: at once)
    assert f"{signal.Signals(sig).name} received: finishing step {step}, then saving" in stderr, stderr[-3000:]
    from megatron_dapo.actor.checkpoint import step_dir
    from megatron_dapo.actor.checkpoint_files import verify

    assert verify(step_dir(folder_of(tmp_path, "term"), step)) is None and str(step_dir(folder_of(tmp_path, "term"), step)) in line
    assert not (folder_of(tmp_path, "term") / ".lock").exists()
    r = run(cmd, env)
    assert r.returncode == 0, r.stderr[-4000:]
    assert_replays(straight, tmp_path, "term", range(1, 4))
    return helpers


@pytest.mark.slow
def test_sigterm_saves_the_step_and_resume_replays_exactly(base_dir, straight, tmp_path, env):
    preempt_and_resume(base_dir, straight, tmp_path, env, signal.SIGTERM, save_every=0)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_to_every_process_spares_the_helpers_and_resume_replays(base_dir, straight, tmp_path, env, sig):
    """The helpers outlive the job's signal: a helper the checkpoint writer started (megatron-core's spawned
    Manager once, multiprocessing's resource tracker now) used to die of the job's SIGTERM first, and the
    trainer's save of the step in flight then failed with BrokenPipeError."""
    helpers = preempt_and_resume(base_dir, straight, tmp_path, env, sig, save_every=1)
    assert any("multiprocessing" in h for h in helpers), helpers  # the tracker was signalled too, and lives


@pytest.mark.slow
def test_ctrl_c_exits_130_with_one_line_and_keeps_the_last_checkpoint(base_dir, tmp_path, env):
    cmd = train_cmd(base_dir, tmp_path, "int", "train.steps=6", "eval.every_steps=0", "checkpoint.save_every=1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group, as a terminal's foreground job
    folder = folder_of(tmp_path, "int")
    wait_for(lambda: (folder / "step_00000001" / "COMPLETE").exists(), proc)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches every process of the group
    _, stderr = proc.communicate(timeout=300)
    r = subprocess.CompletedProcess(cmd, proc.returncode, "", stderr)
    line = one_line(r, 130, "train: interrupted (Ctrl-C): last complete checkpoint:")
    assert "Ctrl-C received: stopping now" in stderr, stderr[-3000:]  # acknowledged when it arrived
    from megatron_dapo.actor.checkpoint import newest_verified

    newest, skipped = newest_verified(folder)
    assert newest is not None and not skipped and newest.name in line, (line, skipped)
    assert "rerun the same command" in line and "SIGTERM" in line, line  # how to resume; what would have saved


# ----------------------------------------------------------------------- bad input at start


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size, ro) -> a fresh tmpfs folder (root only; the test says so when it cannot mount)."""
    mounted: list[Any] = []

    def mount(size: str, read_only: bool = False) -> Path:
        where = tmp_path / f"mnt{len(mounted)}"
        where.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}{',ro' if read_only else ''}", "tmpfs",
                            str(where)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); tests/test_run_dir.py covers the logic")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], capture_output=True)


@pytest.mark.parametrize("kind", ["read_only", "full"])
def test_an_unwritable_or_full_checkpoint_folder_fails_at_start(base_dir, tmp_path, env, tmpfs, kind):
    where = tmpfs("1m", read_only=True) if kind == "read_only" else tmpfs("64k")
    cmd = train_cmd(base_dir, tmp_path, "x", *STEPS)
    cmd[cmd.index(f"checkpoint.dir={tmp_path / 'ckpt'}")] = f"checkpoint.dir={where}"
    t0 = time.time()
    r = run(cmd, env)
    needle = "is not writable" if kind == "read_only" else "free, one checkpoint needs about"
    one_line(r, 2, str(where), needle)
    assert "training prompts" not in r.stderr  # before the data (and the model) load
    print(f"{kind}: refused after {time.time() - t0:.0f} s")


def broken_model(base_dir: Path, tmp_path: Path, kind: str) -> Path:
    hf = tmp_path / f"hf_{kind}"
    shutil.copytree(base_dir, hf)
    config = json.loads((hf / "config.json").read_text())
    if kind == "unsupported_architecture":
        (hf / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"],
                                                    "model_type": "gpt2"}))
    elif kind == "invalid_config_json":
        (hf / "config.json").write_text(json.dumps(config)[:-20])
    elif kind == "missing_weights":
        (hf / "model.safetensors").unlink()
    elif kind == "corrupt_weights":
        data = (hf / "model.safetensors").read_bytes()
        (hf / "model.safetensors").write_bytes(data[: len(data) // 3])
    elif kind == "missing_tokenizer":
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (hf / f).unlink(missing_ok=True)
    return hf


@pytest.mark.parametrize("kind, needle", [
    ("unsupported_architecture", "GPT2LMHeadModel"), ("invalid_config_json", "config.json: not valid JSON"),
    ("missing_weights", "no model.safetensors"), ("corrupt_weights", "truncated"),
    ("missing_tokenizer", "no tokenizer files"),
])
def test_a_broken_model_folder_is_one_line(base_dir, tmp_path, env, kind, needle):
    hf = broken_model(base_dir, tmp_path, kind)
    r = run(train_cmd(hf, tmp_path, "m", *STEPS), env)
    one_line(r, 2, needle)


# ------------------------------------------------------------------------------ process groups


def test_a_single_node_store_listens_on_loopback_only(env):
    code = """
import psutil, torch.distributed as dist
from megatron_dapo import parallel
from megatron_dapo.config import ParallelConfig
parallel.initialize(ParallelConfig(backend="gloo"), seed=0)
dist.barrier()
print([c.laddr.ip for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN])
parallel.destroy()
"""
    r = run([sys.executable, "-c", code], env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    listening = eval(r.stdout.strip().splitlines()[-1])  # noqa: S307 - our own printed list
    assert listening and all(ip in ("127.0.0.1", "::1") for ip in listening), listening


@pytest.mark.parametrize("environ, world, addr, expected", [
    ({}, 1, "10.0.0.1", True),
    ({"SLURM_JOB_NUM_NODES": "1"}, 2, "node17", True),
    ({}, 4, "127.0.0.1", True),
    ({"SLURM_JOB_NUM_NODES": "2"}, 16, "node17", False),
    ({"TORCHELASTIC_USE_AGENT_STORE": "True"}, 2, "127.0.0.1", False),  # torchrun's agent owns the store
])
def test_which_jobs_count_as_single_node(environ, world, addr, expected):
    from megatron_dapo.parallel import LaunchEnv, single_node

    assert single_node(LaunchEnv(0, world, 0, addr, 29500), environ) is expected
