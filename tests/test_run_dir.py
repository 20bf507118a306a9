"""In-process: the run folder's lock, writability and ownership rules
(megatron_dapo/loop/run_dir.py), and the config comparison behind the loud resume warning.
tests/test_reliability.py runs the same paths through the trainer."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest
from support import fake_checkpoint

from megatron_dapo.loop import run_dir
from megatron_dapo.loop.run_dir import RunFolderError, RunLock, check_writable, claim


def write_lock(folder: Path, **fields) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".lock").write_text(json.dumps({"host": socket.gethostname(), "since": "before", **fields}))
    return folder / ".lock"


def test_lock_is_exclusive_and_released(tmp_path):
    lock = RunLock.acquire(tmp_path)
    record = json.loads((tmp_path / ".lock").read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    with pytest.raises(RunFolderError, match=f"in use by pid {os.getpid()}"):
        RunLock.acquire(tmp_path)
    lock.release()
    assert not (tmp_path / ".lock").exists()
    RunLock.acquire(tmp_path).release()


def test_a_folder_left_empty_goes_with_the_lock(tmp_path):
    """A run that fails before its first checkpoint leaves no empty checkpoints/<run>/ behind."""
    empty, kept = tmp_path / "ckpt" / "failed", tmp_path / "ckpt" / "saved"
    RunLock.acquire(empty).release()
    assert not empty.exists() and (tmp_path / "ckpt").is_dir()
    lock = RunLock.acquire(kept)
    (kept / "step_00000001").mkdir()
    lock.release()
    assert (kept / "step_00000001").is_dir() and not (kept / ".lock").exists()


def test_a_live_holder_on_this_host_keeps_the_lock(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = Path(f"/proc/{holder.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        write_lock(tmp_path, pid=holder.pid, pid_start=start)
        with pytest.raises(RunFolderError, match=f"in use by pid {holder.pid}"):
            RunLock.acquire(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    RunLock.acquire(tmp_path).release()  # gone now: stale


@pytest.mark.parametrize("fields, age, why", [
    ({"pid": 2 ** 22 + 17}, 0, "on this host is gone"),
    ({"pid": 1, "pid_start": "0"}, 0, "on this host is gone"),  # pid reused by another process
    ({"host": "elsewhere", "pid": 5}, 3600, "no heartbeat from elsewhere"),
    ({"host": "elsewhere", "pid": 5, "slurm_job": "4242"}, 0, "earlier run of Slurm job 4242"),
])
def test_stale_locks_are_reported_and_taken_over(tmp_path, monkeypatch, caplog, fields, age, why):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    path = write_lock(tmp_path, **fields)
    os.utime(path, (time.time() - age, time.time() - age))
    with caplog.at_level("WARNING"):
        lock = RunLock.acquire(tmp_path)
    assert any("stale lock" in r.message and why in r.message for r in caplog.records), caplog.text
    assert json.loads(path.read_text())["pid"] == os.getpid()
    lock.release()


def test_a_fresh_lock_of_another_host_is_respected(tmp_path):
    write_lock(tmp_path, host="elsewhere", pid=5)
    with pytest.raises(RunFolderError, match="in use by pid 5 on elsewhere"):
        RunLock.acquire(tmp_path)


def test_heartbeat_refreshes_the_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(run_dir, "HEARTBEAT_S", 0.05)
    lock = RunLock.acquire(tmp_path)
    os.utime(lock.path, (0, 0))
    time.sleep(0.5)
    assert time.time() - lock.path.stat().st_mtime < 5
    lock.release()


def test_writability_and_free_space(tmp_path, monkeypatch):
    check_writable(tmp_path / "a" / "b", need_bytes=1)
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunFolderError, match="is not writable"):
        check_writable(tmp_path / "file" / "run")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10 << 30, 10 << 30, 3 << 20))
    with pytest.raises(RunFolderError, match=r"only 3.0 MiB free, one checkpoint needs about 1.0 GiB"):
        check_writable(tmp_path / "c", need_bytes=1 << 30)


def test_claim_rules(tmp_path):
    folder = tmp_path / "run"
    assert claim(folder, "none", False) == (None, [])  # an empty folder is free
    for step in (1, 2, 3):
        fake_checkpoint(folder, step)
    with pytest.raises(RunFolderError, match="holds another run's checkpoints"):
        claim(folder, "none", False)
    start, notes = claim(folder, "auto", False)
    assert start.name == "step_00000003" and notes == []
    with pytest.raises(RunFolderError, match="holds checkpoints newer than the one resumed"):
        claim(folder, str(folder / "step_00000001"), False)
    start, notes = claim(folder, str(folder / "step_00000001"), True)
    assert start.name == "step_00000001" and sorted(p.name for p in folder.iterdir()) == ["step_00000001"]
    assert [n.split(": ")[1] for n in notes] == [f"deleted {folder / 'step_00000002'}", f"deleted {folder / 'step_00000003'}"]
    other = tmp_path / "other"
    fake_checkpoint(other, 7)
    with pytest.raises(RunFolderError, match="holds another run's checkpoints"):  # branching into a used folder
        claim(other, str(folder / "step_00000001"), False)
    (folder / "step_00000001" / "manifest.json").unlink()
    with pytest.raises(RunFolderError, match="no manifest.json"):
        claim(tmp_path / "fresh", str(folder / "step_00000001"), False)


def test_resume_auto_sets_a_corrupt_newest_aside(tmp_path):
    folder = tmp_path / "run"
    for step in (1, 2):
        fake_checkpoint(folder, step)
    (folder / "step_00000002" / ".metadata").unlink()
    start, notes = claim(folder, "auto", False)
    assert start.name == "step_00000001"
    assert notes == ["checkpoint step_00000002 skipped: .metadata is missing; moved aside to step_00000002.corrupt"]
    assert (folder / "step_00000002.corrupt").is_dir() and not (folder / "step_00000002").exists()


def test_config_changes_name_what_differs():
    from megatron_dapo.config import Config, to_dict
    from megatron_dapo.config import config_changes

    a, b = to_dict(Config()), to_dict(Config())
    b["train"]["seed"], b["algo"]["eps_high"] = 2, 0.3
    b["train"]["steps"], b["checkpoint"]["resume"], b["logging"]["run_name"] = 500, "none", "x"  # may change
    b["logging"]["wandb"]["enabled"] = True  # may change: a mirror of the same run
    assert config_changes(a, b) == ["algo.eps_high: None -> 0.3", "train.seed: 1 -> 2"]
