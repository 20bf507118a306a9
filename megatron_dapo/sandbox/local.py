"""`run_code`: one snippet in a bubblewrap sandbox, its wall clock and output bounded from outside."""

from __future__ import annotations

import functools
import os
import selectors
import signal
import subprocess
import time
from typing import IO, cast

from megatron_dapo.sandbox.bwrap import INSTALL_HINT, bwrap_path, launch
from megatron_dapo.sandbox.types import SandboxConfig, SandboxUnavailable, Status, ToolResult

_CHUNK = 65536


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL bwrap's session; bwrap is pid 1's parent, so its pid namespace dies with it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _collect(proc: subprocess.Popen, cfg: SandboxConfig, deadline: float) -> tuple[bytes, bytes, str]:
    """Read both pipes, never more than max_output_bytes each; returns (stdout, stderr, why it was stopped)."""
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for stream in bufs:
        sel.register(stream, selectors.EVENT_READ)
    why = ""
    try:
        while sel.get_map() and not why:
            left = deadline - time.monotonic()
            if left <= 0:
                why = f"wall time {cfg.timeout_s:g} s"
                break
            for key, _ in sel.select(timeout=left):
                data = os.read(key.fd, _CHUNK)
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                buf = bufs[cast(IO[bytes], key.fileobj)]
                buf += data[: cfg.max_output_bytes + 1 - len(buf)]
                if len(buf) > cfg.max_output_bytes:
                    del buf[cfg.max_output_bytes:]
                    why = f"output limit {cfg.max_output_bytes} bytes"
    finally:
        sel.close()
    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), why


def _status(rc: int, why: str, cfg: SandboxConfig) -> tuple[Status, str]:
    if why:
        return ("timeout" if why.startswith("wall") else "killed"), why
    if rc == 0:
        return "ok", ""
    if rc == 128 + signal.SIGXCPU:
        return "timeout", f"cpu time {cfg.cpu_limit_s} s"
    if rc > 128:
        return "killed", f"signal {rc - 128} ({signal.Signals(rc - 128).name})" if rc - 128 < 65 else f"exit {rc}"
    return "error", ""


def run_unchecked(code: str, cfg: SandboxConfig) -> ToolResult:
    """run_code without the once-per-process start-up check."""
    t0 = time.monotonic()
    spec = launch(code, cfg)
    try:
        proc = subprocess.Popen(spec.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, **spec.popen_kwargs())
    except OSError as e:
        spec.close()
        raise SandboxUnavailable(f"sandbox: cannot start bwrap: {e}") from None
    spec.close()  # bwrap has its copies
    try:
        out, err, why = _collect(proc, cfg, t0 + cfg.timeout_s)
        if why:
            _kill(proc)
        try:
            rc = proc.wait(timeout=max(0.0, t0 + cfg.timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:  # closed its pipes, still running
            why = f"wall time {cfg.timeout_s:g} s"
            _kill(proc)
            rc = proc.wait()
    finally:
        if proc.poll() is None:
            _kill(proc)
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    status, reason = _status(rc, why, cfg)
    stderr = err.decode("utf-8", "replace")
    if reason:
        stderr += ("" if not stderr or stderr.endswith("\n") else "\n") + f"[sandbox: {status}: {reason}]\n"
    return ToolResult(status, out.decode("utf-8", "replace"), stderr, round(time.monotonic() - t0, 4),
                      None if why else rc, reason)


@functools.lru_cache(maxsize=8)
def _check(python: str, site_packages: bool) -> None:
    """Start one trivial sandbox; a failure is a one-line refusal, never a fallback to running unsandboxed."""
    probe = run_unchecked("print('sandbox-ok')", SandboxConfig(python=python, site_packages=site_packages,
                                                              timeout_s=30))
    if probe.status != "ok" or probe.stdout.strip() != "sandbox-ok":
        first = next((ln for ln in probe.stderr.splitlines() if ln.strip()), probe.status)
        raise SandboxUnavailable(f"sandbox: bubblewrap cannot start a sandbox here ({first.strip()}); it needs "
                                 f"user namespaces and `{INSTALL_HINT}`")


def check_sandbox(cfg: SandboxConfig) -> None:
    """Raise SandboxUnavailable (one line) unless this machine can sandbox with `cfg`'s interpreter."""
    bwrap_path()  # uncached: a later uninstall counts too
    _check(cfg.python, cfg.site_packages)  # a refusal is not cached: a later install may fix it


def run_code(code: str, cfg: SandboxConfig | None = None) -> ToolResult:
    """Run a Python snippet in the sandbox; see ToolResult for the statuses. Blocks for at most cfg.timeout_s
    (plus the start). Raises SandboxUnavailable when no sandbox can start here."""
    cfg = cfg or SandboxConfig()
    check_sandbox(cfg)
    return run_unchecked(code, cfg)
