"""The SandboxFusion client against a small local service speaking its schema: the mapping onto ToolResult,
retries after a 5xx / a SandboxError / a client timeout, no retry on a 4xx, and the refusal once retries run out."""

from __future__ import annotations

import json
import threading
import time
from typing import Any
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_dapo.sandbox import SandboxConfig, SandboxPool, SandboxUnavailable
from megatron_dapo.sandbox import http as sandbox_http


def fusion(run_status: str = "Finished", rc: int | None = 0, stdout: str = "", stderr: str = "") -> dict:
    """A SandboxFusion /run_code response (sandbox/runners/types.py's CodeRunResult + the API's status)."""
    ok = run_status == "Finished" and rc == 0
    return {"status": "Success" if ok else "Failed", "message": "", "compile_result": None, "files": {},
            "run_result": {"status": run_status, "execution_time": 0.01, "return_code": rc, "stdout": stdout,
                           "stderr": stderr}}


class Service:
    """Answers each POST /run_code with the next scripted reply: a dict (200 JSON), an int (that HTTP status)
    or ("sleep", S, reply). Records the request bodies."""

    def __init__(self, replies: list) -> None:
        self.replies = list(replies)
        self.requests: list[tuple[str, Any]] = []
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                service.requests.append((self.path, body))
                reply = service.replies.pop(0)
                if isinstance(reply, tuple):
                    time.sleep(reply[1])
                    reply = reply[2]
                if isinstance(reply, int):
                    self.send_response(reply)
                    self.end_headers()
                    return
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout)
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def service(monkeypatch):
    monkeypatch.setattr(sandbox_http, "BACKOFF_S", 0.0)
    made = []

    def make(replies, **cfg):
        s = Service(replies)
        made.append(s)
        return s, sandbox_http.HttpSandbox(SandboxConfig(url=s.url + "/", **cfg))

    yield make
    for s in made:
        s.close()


def test_the_request_and_the_statuses(service):
    svc, client = service([fusion(stdout="4\n"), fusion(rc=1, stderr="Traceback ...\nZeroDivisionError\n"),
                           fusion("TimeLimitExceeded", rc=None), fusion(rc=-9), fusion(stdout="y" * 50)],
                          timeout_s=3.0, memory_mb=512, max_output_bytes=40)
    ok = client.run("print(2 + 2)")
    assert (ok.status, ok.stdout, ok.stderr, ok.exit_code) == ("ok", "4\n", "", 0)
    path, body = svc.requests[0]
    assert path == "/run_code"
    assert body == {"code": "print(2 + 2)", "language": "python", "run_timeout": 3.0, "memory_limit_MB": 512}
    err = client.run("1/0")
    assert err.status == "error" and err.exit_code == 1 and "ZeroDivisionError" in err.stderr
    assert client.run("while 1: pass").status == "timeout"
    assert client.run("import os; os.kill(os.getpid(), 9)").status == "killed"
    flood = client.run("print('y' * 50)")
    assert flood.status == "killed" and flood.stdout == "y" * 40 and "output limit 40 bytes" in flood.stderr


def test_retries_after_a_5xx_a_sandbox_error_and_a_client_timeout(service):
    svc, client = service([503, {"status": "SandboxError", "message": "busy"}, ("sleep", 1.5, fusion(stdout="late")),
                           fusion(stdout="done\n")], http_timeout_s=0.5, http_retries=3)
    t0 = time.monotonic()
    r = client.run("print('done')")
    assert r.status == "ok" and r.stdout == "done\n" and len(svc.requests) == 4
    assert time.monotonic() - t0 < 1.4  # the slow reply was abandoned at the client's timeout


def test_gives_up_after_the_retries_and_not_on_a_4xx(service):
    svc, client = service([500, 502, 500], http_retries=2)
    with pytest.raises(SandboxUnavailable, match="failed 3 times, last: HTTP 500"):
        client.run("print(1)")
    assert len(svc.requests) == 3
    svc, client = service([422, fusion()], http_retries=2)
    with pytest.raises(SandboxUnavailable, match="HTTP 422"):
        client.run("print(1)")
    assert len(svc.requests) == 1


def test_the_pool_sends_calls_to_the_service_in_parallel(service):
    n = 4
    svc, _ = service([("sleep", 0.5, fusion(stdout=f"{i}\n")) for i in range(n)])
    t0 = time.monotonic()
    with SandboxPool(SandboxConfig(url=svc.url, workers=n)) as pool:
        results = [f.result() for f in [pool.submit("print(0)") for _ in range(n)]]
    assert sorted(r.stdout for r in results) == [f"{i}\n" for i in range(n)]
    assert time.monotonic() - t0 < n * 0.5


def test_a_bad_url_is_refused():
    with pytest.raises(ValueError, match="sandbox.url must start with http"):
        sandbox_http.HttpSandbox(SandboxConfig(url="localhost:8080"))
