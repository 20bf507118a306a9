"""`SandboxPool`: many snippets' calls in parallel, the caller never blocked (it gets futures)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from megatron_dapo.sandbox.http import HttpSandbox
from megatron_dapo.sandbox.local import check_sandbox, run_unchecked
from megatron_dapo.sandbox.types import SandboxConfig, ToolResult


class SandboxPool:
    """`submit(code) -> Future[ToolResult]`, `cfg.workers` calls at a time.

    Each call is its own sandbox process (bubblewrap) or HTTP request (`cfg.url`); the threads only wait on
    pipes and sockets, so they hold no GIL while the code runs. Construction checks that a local sandbox can
    start (SandboxUnavailable otherwise), so a run fails at start-up, not at its first tool call.
    """

    def __init__(self, cfg: SandboxConfig | None = None) -> None:
        self.cfg = cfg or SandboxConfig()
        if self.cfg.url:
            self._run = HttpSandbox(self.cfg).run
        else:
            check_sandbox(self.cfg)
            self._run = lambda code: run_unchecked(code, self.cfg)
        self._executor = ThreadPoolExecutor(max_workers=self.cfg.workers, thread_name_prefix="sandbox")

    def submit(self, code: str) -> Future[ToolResult]:
        return self._executor.submit(self._run, code)

    def map(self, codes: list[str]) -> list[ToolResult]:
        """All of `codes`, in parallel, results in order (blocks)."""
        return [f.result() for f in [self.submit(c) for c in codes]]

    def close(self) -> None:
        """Cancel the calls not started yet, wait for the running ones (each ends within its timeout)."""
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
