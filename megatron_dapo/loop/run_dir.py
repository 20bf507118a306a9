"""A run owns its checkpoint folder `<checkpoint.dir>/<logging.run_name>/`: checked, locked, claimed.

At start (global rank 0 decides, every rank gets the same answer):
  - the folder is created and must be writable, with room for about one more checkpoint;
  - a lock file `.lock` (host, pid, Slurm job, heartbeat) keeps a second run out; a lock whose
    process is gone, whose heartbeat stopped, or that an earlier run of the same (requeued) Slurm job
    left is stale: reported and taken over;
  - the folder belongs to the checkpoint the run starts from: with resume=none (or a checkpoint from
    elsewhere) it must hold no checkpoint and no hf_final, with a checkpoint inside it none newer than
    that one. Otherwise the run is refused unless checkpoint.overwrite=true, which deletes them;
  - resume=auto takes the newest checkpoint that verifies against its manifest; newer ones that do
    not are named with the reason and moved aside to `step_<N>.corrupt`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_dapo.actor.checkpoint import checkpoints, newest_verified, step_of
from megatron_dapo.actor.checkpoint_files import verify
from megatron_dapo.cli import UserError, preflight_error

log = logging.getLogger(__name__)
LOCK = ".lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0


class RunFolderError(UserError):
    """The run folder cannot be used (not writable, full, locked, holds another run): one line, exit 2."""


def _pid_start(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@dataclass
class RunLock:
    """`<folder>/.lock`: who holds the folder; its mtime is refreshed every HEARTBEAT_S by a thread."""

    path: Path
    _stop: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def acquire(cls, folder: Path) -> RunLock:
        path = folder / LOCK
        folder.mkdir(parents=True, exist_ok=True)  # (and release() removes it if nothing else came in)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _pid_start(os.getpid()),
              "slurm_job": os.environ.get("SLURM_JOB_ID"), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(3):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder, why = _stale(path, me)
                if why is None:
                    raise RunFolderError(
                        f"run folder {folder} is in use by pid {holder.get('pid')} on {holder.get('host')} since "
                        f"{holder.get('since')} (lock {path}): wait for that run, or choose another "
                        "logging.run_name; delete the lock only if that run is gone") from None
                log.warning("run folder %s: taking over a stale lock (%s)", folder, why)
                path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            lock = cls(path)
            threading.Thread(target=lock._beat, name="run-lock-heartbeat", daemon=True).start()
            return lock
        raise RunFolderError(f"run folder {folder}: could not take the lock {path} (another run races for it)")

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        """Drop the lock; a folder left empty (a run that failed before its first checkpoint) goes too."""
        self._stop.set()
        try:
            if json.loads(self.path.read_text()).get("pid") == os.getpid():
                self.path.unlink()
                self.path.parent.rmdir()  # only when empty
        except (OSError, ValueError):
            pass


def _stale(path: Path, me: dict) -> tuple[dict, str | None]:
    """(the holder's record, why its lock is stale, or None while it may be alive)."""
    try:
        age = time.time() - path.stat().st_mtime
        holder = json.loads(path.read_text())
    except FileNotFoundError:
        return {}, "it disappeared"
    except (OSError, ValueError):
        return {}, None if age < 10 else "unreadable lock file"  # (maybe being written right now)
    if holder.get("slurm_job") and holder["slurm_job"] == me["slurm_job"]:
        return holder, f"left by an earlier run of Slurm job {holder['slurm_job']} (requeued)"
    if holder.get("host") == me["host"]:
        pid = int(holder.get("pid", -1))
        if _pid_start(pid) is None or (holder.get("pid_start") and _pid_start(pid) != holder["pid_start"]):
            return holder, f"pid {pid} on this host is gone"
        return holder, None
    if age > STALE_AFTER_S:
        return holder, f"no heartbeat from {holder.get('host')} for {age:.0f} s"
    return holder, None


def check_writable(folder: Path, need_bytes: int = 0) -> None:
    """Create `folder`; RunFolderError unless a file can be written there and ~need_bytes are free."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write_test.{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        raise RunFolderError(f"checkpoint folder {folder} is not writable ({e.strerror or e}): fix it or "
                             "point checkpoint.dir elsewhere") from None
    free = shutil.disk_usage(folder).free
    if free < need_bytes:
        raise RunFolderError(f"checkpoint folder {folder}: only {_human(free)} free, one checkpoint needs about "
                             f"{_human(need_bytes)}: free space or point checkpoint.dir elsewhere")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def open_folder(folder: Path, need_bytes: int) -> RunLock | None:
    """Collective: rank 0 checks the folder is writable with room for a checkpoint and takes its lock
    (returned there; None elsewhere). Every rank raises the same RunFolderError if that fails."""
    from megatron_dapo import parallel

    lock, problem = None, None
    if parallel.is_main():
        try:
            check_writable(folder, need_bytes)
            lock = RunLock.acquire(folder)
        except RunFolderError as e:
            problem = str(e)
    problem = _from_driver(problem)
    if problem:
        raise preflight_error(RunFolderError(problem))
    return lock


def claim(folder: Path, resume: str, overwrite: bool) -> tuple[Path | None, list[str]]:
    """Collective. The checkpoint to start from (None: from scratch) and warnings to log; enforces
    ownership (see the module docstring). Call with the lock held."""
    warnings: list[str] = []
    if resume == "auto":
        start, skipped = newest_verified(folder)
        for path, why in skipped:
            warnings.append(f"checkpoint {path.name} skipped: {why}; moved aside to {path.name}.corrupt")
    elif resume == "none":
        start, skipped = None, []
    else:
        start, skipped = Path(resume), []
        problem = verify(start)
        if problem is not None:
            raise preflight_error(RunFolderError(f"checkpoint.resume={resume}: {problem}"))
    return start, warnings + _own(folder, start, skipped, overwrite)


def _own(folder: Path, start: Path | None, skipped: list, overwrite: bool) -> list[str]:
    """Rank 0 (the others wait): set corrupt ones aside; refuse or delete what belongs to another run."""
    from megatron_dapo import parallel

    problem: str | None = None
    done: list[str] = []
    if parallel.is_main():
        for path, _ in skipped:
            shutil.rmtree(path.with_name(path.name + ".corrupt"), ignore_errors=True)
            path.rename(path.with_name(path.name + ".corrupt"))
        inside = start is not None and start.resolve().parent == folder.resolve()
        floor = step_of(start) if inside else -1
        others = [p for p in checkpoints(folder) if step_of(p) > floor]
        if not inside and (folder / "hf_final").exists():
            others.append(folder / "hf_final")
        if others and not overwrite:
            what = "checkpoints newer than the one resumed" if inside else "another run's checkpoints"
            problem = (f"run folder {folder} holds {what} ({', '.join(p.name for p in others[-3:])}): choose another "
                       "logging.run_name, continue it with checkpoint.resume=auto, or replace them with "
                       "checkpoint.overwrite=true")
        for path in others if overwrite else []:
            shutil.rmtree(path)
            done.append(f"checkpoint.overwrite=true: deleted {path}")
    problem, done = _from_driver((problem, done))
    if problem:
        raise preflight_error(RunFolderError(problem))
    return done


def _from_driver(obj: Any) -> Any:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
