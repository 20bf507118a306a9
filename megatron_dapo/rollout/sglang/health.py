"""A launched server's health check: a daemon thread asks for the schedulers' load report every few seconds (it
crosses the whole server and generates nothing: SGLang's /health generates a token, which must not reach a server
that releases its memory; /model_info on an SGLang without the report). A server that has not answered for
`timeout_s` counts as hung (SGLangServer.call gives up on it, its driver may restart it)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


PATHS = ("/v1/loads?include=core", "/model_info")


class HealthWatch:
    """Asks `get(path, timeout)` (an HTTP status) every min(5 s, timeout_s / 4) until `stop()`."""

    def __init__(self, get: Callable[[str, float], int], timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.interval_s = min(5.0, timeout_s / 4)
        self._get, self._paths = get, list(PATHS)
        self._seen = time.monotonic()
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="sglang-health", daemon=True).start()

    def hung(self) -> str | None:
        """Why the server counts as hung (None: it answered its health check within timeout_s)."""
        silent = time.monotonic() - self._seen
        if silent <= self.timeout_s:
            return None
        return (f"did not answer its health check for {silent:.0f} s "
                f"(rollout.sglang.health_timeout_s={self.timeout_s:g})")

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                ok = self._answers(max(1.0, min(10.0, self.timeout_s / 2)))
            except Exception:  # noqa: BLE001 - an unanswered check is what this counts
                ok = False
            if ok and not self._stop.is_set():
                self._seen = time.monotonic()

    def _answers(self, timeout: float) -> bool:
        status = self._get(self._paths[0], timeout)
        if status == 404 and len(self._paths) > 1:  # an SGLang without the load report
            self._paths.pop(0)
            status = self._get(self._paths[0], timeout)
        return status == 200
