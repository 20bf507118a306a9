"""A SandboxFusion-compatible service as the sandbox: POST {url}/run_code, mapped onto the same ToolResult.

Request: {"code", "language": "python", "run_timeout", "memory_limit_MB"}. Response (SandboxFusion's
sandbox/runners/types.py): {"status": "Success" | "Failed" | "SandboxError", "run_result": {"status":
"Finished" | "TimeLimitExceeded" | "Error", "return_code", "stdout", "stderr", "execution_time"}}.
A connection error, a client timeout, an HTTP 5xx or a "SandboxError" is retried `http_retries` times (backoff
0.5, 1, 2 ... s); then SandboxUnavailable. Another HTTP error (4xx: a bad request) is not retried.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

from megatron_dapo.sandbox.types import SandboxConfig, SandboxUnavailable, Status, ToolResult


BACKOFF_S = 0.5  # the first retry's wait; doubles, at most 8 s


class _Retry(Exception):
    pass


def _text(value: object, limit: int) -> tuple[str, bool]:
    raw = str(value or "").encode("utf-8", "replace")
    return raw[:limit].decode("utf-8", "ignore"), len(raw) > limit


def to_result(body: dict, cfg: SandboxConfig, seconds: float) -> ToolResult:
    """SandboxFusion's response as a ToolResult (the statuses of types.ToolResult)."""
    if body.get("status") == "SandboxError":
        raise _Retry(f"SandboxError: {body.get('message', '')}")
    run = body.get("run_result") or {}
    stdout, cut_out = _text(run.get("stdout"), cfg.max_output_bytes)
    stderr, cut_err = _text(run.get("stderr"), cfg.max_output_bytes)
    rc = run.get("return_code")
    state = run.get("status")
    status: Status
    if state == "TimeLimitExceeded":
        status, reason = "timeout", f"wall time {cfg.timeout_s:g} s (service)"
    elif cut_out or cut_err:
        status, reason = "killed", f"output limit {cfg.max_output_bytes} bytes"
    elif state == "Finished" and rc == 0:
        status, reason = "ok", ""
    elif state == "Finished" and isinstance(rc, int) and (rc < 0 or rc > 128):
        status, reason = "killed", f"signal {abs(rc) if rc < 0 else rc - 128} (service)"
    else:
        status, reason = "error", "" if state == "Finished" else f"service run status {state!r}"
    if reason:
        stderr += ("" if not stderr or stderr.endswith("\n") else "\n") + f"[sandbox: {status}: {reason}]\n"
    return ToolResult(status, stdout, stderr, round(seconds, 4), rc if isinstance(rc, int) else None, reason)


class HttpSandbox:
    def __init__(self, cfg: SandboxConfig) -> None:
        if not cfg.url.startswith(("http://", "https://")):
            raise ValueError(f"sandbox.url must start with http:// or https://, got {cfg.url!r}")
        self.cfg = cfg
        self.endpoint = cfg.url.rstrip("/") + "/run_code"

    def _post(self, payload: bytes) -> dict:
        req = urllib.request.Request(self.endpoint, data=payload, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.cfg.request_timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            if e.code >= 500:
                raise _Retry(f"HTTP {e.code}") from None
            raise SandboxUnavailable(f"sandbox: {self.endpoint} refused the request: HTTP {e.code}") from None
        except (urllib.error.URLError, socket.timeout, ConnectionError, TimeoutError) as e:
            raise _Retry(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from None
        except json.JSONDecodeError as e:
            raise _Retry(f"not JSON: {e}") from None

    def run(self, code: str) -> ToolResult:
        payload = json.dumps({"code": code, "language": "python", "run_timeout": self.cfg.timeout_s,
                              "memory_limit_MB": self.cfg.memory_mb}).encode()
        why = ""
        for attempt in range(self.cfg.http_retries + 1):
            if attempt:
                time.sleep(min(BACKOFF_S * 2 ** (attempt - 1), 8.0))
            t0 = time.monotonic()
            try:
                return to_result(self._post(payload), self.cfg, time.monotonic() - t0)
            except _Retry as e:
                why = str(e)
        raise SandboxUnavailable(f"sandbox: {self.endpoint} failed {self.cfg.http_retries + 1} times, last: {why}")
