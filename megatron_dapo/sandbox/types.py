"""The sandbox's typed contract: its limits (`SandboxConfig`) and one call's outcome (`ToolResult`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

Status = Literal["ok", "error", "timeout", "killed"]
STATUSES: tuple[Status, ...] = ("ok", "error", "timeout", "killed")


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot start here; the message is one line naming the fix. Code never runs unsandboxed."""


@dataclass
class SandboxConfig:
    """Limits of one call. The later `rollout.tools` config nests this."""

    timeout_s: float = 10.0  # wall clock of a call, enforced from outside (the sandbox is killed): status timeout
    cpu_s: float = 0.0  # CPU seconds (RLIMIT_CPU); 0 = timeout_s rounded up: status timeout
    memory_mb: int = 1024  # address space of each process (RLIMIT_AS): allocations beyond fail (MemoryError);
    # a call holds at most memory_mb x max_processes + disk_mb (its /tmp is memory)
    max_processes: int = 4  # processes + threads, the snippet's included (RLIMIT_NPROC, non-root uid in its userns)
    max_output_bytes: int = 65536  # per stream; more and the sandbox is killed: status killed, output truncated
    disk_mb: int = 64  # size of its /tmp (the only writable place) and RLIMIT_FSIZE
    max_open_files: int = 256  # RLIMIT_NOFILE
    python: str = ""  # interpreter that runs the snippet; "" = this process's (its real path, stdlib read-only)
    site_packages: bool = True  # the interpreter's site-packages (numpy, sympy, ...), read-only; False = stdlib only
    workers: int = 4  # SandboxPool's parallel calls
    url: str = ""  # a SandboxFusion-compatible service (POST {url}/run_code) instead of the local bubblewrap
    http_retries: int = 3  # attempts after the first on a connection error, a 5xx or a SandboxError
    http_timeout_s: float = 0.0  # one HTTP request's limit; 0 = timeout_s + 10

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_mb", "max_processes", "max_output_bytes", "disk_mb", "max_open_files",
                     "workers"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("cpu_s", "http_timeout_s", "http_retries"):
            if getattr(self, name) < 0:
                raise ValueError(f"sandbox.{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def cpu_limit_s(self) -> int:
        return math.ceil(self.cpu_s or self.timeout_s)

    @property
    def request_timeout_s(self) -> float:
        return self.http_timeout_s or self.timeout_s + 10.0


@dataclass(frozen=True)
class ToolResult:
    """One call's outcome.

    status: ok (exit 0) | error (nonzero exit, e.g. an exception or MemoryError: stderr holds the traceback) |
    timeout (wall clock or CPU limit) | killed (a signal, e.g. SIGSEGV or the kernel's OOM killer, or the output
    limit was exceeded). A sandbox's own note ("[sandbox: ...]") ends stderr when it stopped the code.
    """

    status: Status
    stdout: str
    stderr: str
    seconds: float
    exit_code: int | None = None  # the snippet's exit status; 128 + N for signal N; None where it was killed
    reason: str = ""  # why the sandbox stopped it (wall time, cpu time, output limit, signal N), "" otherwise

    def to_json(self) -> dict[str, object]:
        """The CLI's line: status, stdout, stderr, seconds."""
        d = asdict(self)
        return {k: d[k] for k in ("status", "stdout", "stderr", "seconds")}
