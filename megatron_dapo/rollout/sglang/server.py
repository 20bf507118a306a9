"""One `sglang.launch_server` process and its HTTP API, with every wait bounded.

`SGLangServer` starts the server from its own python (`python=`; on CPU the venv that
`tools/sglang_venv.sh` builds), bound to `host` (127.0.0.1 unless remote ranks need it), with
`--skip-tokenizer-init`; or attaches to one another process started. Every HTTP call has a timeout and
runs while the server's process tree is watched: a server that exits, or does not answer in time,
raises `SGLangServerError` naming the address, the PID and the log file, with the log's last lines.
`SGLangEngine` (engine.py) adds the rollout API on top; process.py handles the process tree.
"""

from __future__ import annotations

import atexit
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any, Literal

import torch

from megatron_dapo.config import SGLangConfig
from megatron_dapo.rollout.base import EngineStateError
from megatron_dapo.rollout.sglang.environment import missing_cuda_modules, server_environment
from megatron_dapo.rollout.sglang.health import HealthWatch
from megatron_dapo.rollout.sglang.launch import default_python, launch_command
from megatron_dapo.rollout.sglang.process import (
    child_processes,
    file_tail,
    in_lasting_thread,
    kill_process_group,
    port_in_use,
    refuses_connections,
    same_process,
    start_server_process,
)

_LOG_TAIL_LINES = 30
_REAP_WAIT_S = 5.0


class SGLangServerError(RuntimeError):
    """The SGLang server died, did not start, did not answer in time, or refused a request."""


class SGLangServer:
    """The server process (or an attached one) and bounded HTTP calls to it; see SGLangEngine for the
    constructor's arguments."""

    def __init__(
        self,
        model_path: str | Path,
        cfg: SGLangConfig | None = None,
        *,
        python: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        server_index: int = 0,
        dtype: str = "auto",
        device: Literal["auto", "cpu", "cuda"] = "auto",
        colocate: bool = True,
        max_total_tokens: int | None = None,
        log_dir: str | Path | None = None,
        extra_args: Sequence[str] = (),
        shutdown_grace_s: float = 15.0,
        kill_with_parent: bool = True,
        wait: bool = True,
        attach: bool = False,
        api_key: str | None = None,
        threads: int | None = None,
        deterministic: bool = False,
        return_routes: bool = False,
    ) -> None:
        self.cfg = cfg or SGLangConfig()
        self.deterministic = deterministic
        """train.deterministic: SGLang's deterministic inference (DETERMINISTIC_FLAG; on a GPU only)."""
        self.return_routes = return_routes
        """actor.routing_replay=r3: the server captures every token's routed experts (wire.ROUTES_FLAG)."""
        self.api_key = api_key
        """Sent as `Authorization: Bearer` with every request; a started server gets `--api-key`."""
        self.threads = threads
        """On CPU: the server's OMP threads (its own cores); None = the environment's."""
        self.model_path = str(model_path)
        self.python = python or default_python()
        self.host = host
        self.port = int(port if port is not None else self.cfg.base_port + server_index)
        self.server_index = server_index
        self.url = f"http://{host}:{self.port}"
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = device
        self.shutdown_grace_s = shutdown_grace_s
        self.kill_with_parent = kill_with_parent
        log_dir = (
            Path(log_dir) if log_dir is not None else Path(tempfile.gettempdir()) / "megatron-dapo-sglang"
        )
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"sglang-{host}-{self.port}.log"
        self._closed = False
        self._proc: subprocess.Popen | None = None
        self._watchdog: int | None = None  # the write end of the pipe the server's watchdog reads
        self._children: list[tuple[int, float]] = []
        self.attached = attach
        self.restarter: Callable[[], None] | None = None
        """An attached server's restart by the rank that started it (rank 0's: fleet.py); None: never restarted."""
        self._call_failed: float | None = None  # when a call last failed (time.monotonic)
        self._health: HealthWatch | None = None
        self._ready = threading.Event()  # clear while a restart is under way: calls wait for it
        self._ready.set()
        self._cmd = launch_command(self, dtype, colocate, max_total_tokens, extra_args)
        self._started_at = time.monotonic()
        if not attach:
            self._check_python(colocate)
            self._start()
        if wait:
            self.wait_ready()

    # ------------------------------------------------------------------------------- lifecycle

    def _server_env(self) -> dict[str, str]:
        own = Path(self.python).resolve() == Path(sys.executable).resolve()
        env = server_environment(dict(os.environ), own_python=own, device=self.device)
        if self.device == "cpu" and self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        return env

    def _check_python(self, colocate: bool) -> None:
        """On a GPU, refuse an SGLang install without its CUDA kernels (the CPU venv) in one line."""
        if self.device != "cuda":
            return
        missing = missing_cuda_modules(self.python, memory_saver=colocate)
        if missing:
            raise SGLangServerError(
                f"cannot start SGLang on CUDA with {self.python}: it lacks {', '.join(missing)} (a CPU "
                f"build, such as tools/sglang_venv.sh's venv); set MEGATRON_DAPO_SGLANG_PYTHON to an SGLang "
                f"install with its CUDA kernels")

    def _start(self) -> None:
        if port_in_use(self.host, self.port):
            raise SGLangServerError(f"cannot start SGLang server at {self.url}: the port is already in use")
        # the log shows the server's arguments: readable by its owner only when they hold a key
        with os.fdopen(os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if self.api_key else 0o644),
                       "wb") as log:
            shown = [("--api-key=<api key>" if a.startswith("--api-key=") else a) for a in self._cmd]
            log.write(("$ " + shlex.join(shown) + "\n").encode())
            log.flush()
            self._proc, self._watchdog = start_server_process(
                self._cmd, stdout=log, env=self._server_env(), kill_with_parent=self.kill_with_parent,
                grace_s=self.shutdown_grace_s)
        _LIVE_SERVERS.add(self)
        self._started_at = time.monotonic()

    def wait_ready(self) -> None:
        """Wait for /health (up to cfg.startup_timeout_s from the start); on failure stop it and raise.
        Interrupted (a stop signal while the trainer starts), it kills the server at once: nothing to save."""
        try:
            self._wait_ready()
        except BaseException:
            self._closed = True
            self._kill(grace_s=0.0)  # also the watchdog of a server that exited
            _LIVE_SERVERS.discard(self)
            raise
        finally:
            self._ready.set()

    def _wait_ready(self) -> None:
        deadline = self._started_at + self.cfg.startup_timeout_s
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                self._closed = True
                _LIVE_SERVERS.discard(self)
                raise self._error(f"exited with code {self._proc.returncode} during startup")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            fatal = self._fatal_startup_error()
            if fatal is not None or time.monotonic() > deadline:
                self._kill()
                self._closed = True
                _LIVE_SERVERS.discard(self)
                raise self._error(
                    f"failed to start ({fatal}); killed it" if fatal else
                    f"did not become healthy within {self.cfg.startup_timeout_s:.0f} s; killed it"
                )
            time.sleep(0.5)
        self._children = child_processes(self._proc.pid) if self._proc is not None else []
        if self._proc is not None or self.attached:
            self._health = HealthWatch(lambda path, t: self._http("GET", path, None, timeout=t)[0],
                                       self.cfg.health_timeout_s)

    def _fatal_startup_error(self) -> str | None:
        """A startup failure after which SGLang lingers instead of exiting (its HTTP port taken: uvicorn
        logs the error, then the process waits in shutdown while other processes hold our port)."""
        if self._proc is None:
            return None
        for line in self.log_tail(lines=_LOG_TAIL_LINES).splitlines():
            if "error while attempting to bind on address" in line:
                return line.split("ERROR:", 1)[-1].strip()
        return None

    def dead_reason(self) -> str | None:
        """Why the server cannot answer: its main process exited, or one of its workers died."""
        if self._proc is None:
            return None if self.attached else "was never started"
        if self._proc.poll() is not None:
            return f"exited with code {self._proc.returncode}"
        dead = next((pid for pid, started in self._children if not same_process(pid, started)), None)
        if dead is None:
            return None
        # A killed server's workers die with the thread that started them, while its main process may still be
        # tearing down (and poll() says nothing while another thread waits on it): report its exit if it comes.
        with suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=_REAP_WAIT_S)
        if self._proc.returncode is not None:
            return f"exited with code {self._proc.returncode}"
        return f"worker process {dead} died"

    def _dead_reason_settled(self, connection_failed: bool = False) -> str | None:
        """As dead_reason, but give a dying main process a moment so its exit code is what we report
        (a killed server closes its sockets a moment before it can be reaped)."""
        reason = self.dead_reason()
        if connection_failed and reason is None and self._proc is not None:
            with suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=1.0)
            reason = self.dead_reason()
        return reason

    def hung(self) -> str | None:
        """Why the server counts as hung (its health check silent for cfg.health_timeout_s), None if it is not."""
        return self._health.hung() if self._health is not None else None

    def lost(self) -> str | None:
        """Why a started server is lost for good (dead: an attached one's port refuses connections; or hung)."""
        if self._closed or not self._ready.is_set() or (self.attached and self.restarter is None):
            return None
        if self.attached:
            return self.hung() or self._refuses()
        return self.dead_reason() or self.hung()

    def _refuses(self) -> str | None:
        """An attached server's port refuses connections; for a few seconds right after a call of ours failed."""
        patient = self._call_failed is not None and time.monotonic() - self._call_failed < 30
        gone = refuses_connections(self.host, self.port, patience_s=3.0 if patient else 0.0)
        return "refuses connections (its process is gone)" if gone else None

    def kill(self) -> None:
        """Stop the server's process group at once (no grace); calls wait for restart() (an attached one's)."""
        if self.attached and self.restarter is None:
            raise EngineStateError(f"SGLang engine {self.url} is attached: its own node restarts it")
        self._ready.clear()
        if self.attached:
            if self._health is not None:
                self._health.stop()
                self._health = None
            return
        self._kill(grace_s=0.0)

    def restart(self) -> None:
        """Stop the server for good (its whole process group, at once: a hung server gets no grace) and start
        it again on the same devices and port; returns once it answers. It holds the checkpoint's weights. An
        attached one is restarted by the rank that started it (`restarter`)."""
        self.kill()
        self._closed = False
        try:
            if self.attached:
                self.restarter()  # type: ignore[misc]
                self._started_at, self._call_failed = time.monotonic(), None
            else:
                in_lasting_thread(self._start)
        except BaseException:
            self._closed = True
            self._ready.set()
            raise
        self.wait_ready()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        return file_tail(self.log_path, lines)

    def _error(self, what: str) -> SGLangServerError:
        return SGLangServerError(
            f"SGLang server {self.url} ({'attached' if self.attached else f'pid {self.pid}'}) {what}; "
            f"log: {self.log_path}\n"
            f"--- last lines of {self.log_path} ---\n{self.log_tail()}"
        )

    def _kill(self, grace_s: float | None = None) -> None:
        """Ask the server's process group to stop, SIGKILL it after the grace period; by PID, never by name."""
        if self._health is not None:
            self._health.stop()
            self._health = None
        if self._proc is not None:
            kill_process_group(self._proc, self._children, self.shutdown_grace_s if grace_s is None else grace_s)
        if self._watchdog is not None:
            os.close(self._watchdog)
            self._watchdog = None

    def shutdown(self) -> None:
        """Stop the server (an attached one is only let go); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._kill()
        _LIVE_SERVERS.discard(self)

    # ------------------------------------------------------------------------------------ http

    def _http(self, method: str, path: str, body: Any, timeout: float) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def call(self, method: str, path: str, body: Any = None, *, timeout: float) -> Any:
        """One HTTP call with a hard deadline, watching the server's processes while it runs."""
        if not self._ready.is_set():  # a restart is under way
            self._ready.wait(self.cfg.startup_timeout_s)
        if self._closed:
            raise EngineStateError(f"SGLang engine {self.url} is shut down")
        result: dict[str, Any] = {}

        def work() -> None:
            try:
                result["response"] = self._http(method, path, body, timeout)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                result["error"] = e

        worker = threading.Thread(target=work, name=f"sglang-http{path}", daemon=True)
        worker.start()
        deadline = time.monotonic() + timeout
        while worker.is_alive():
            worker.join(min(1.0, max(0.0, deadline - time.monotonic())))
            if not worker.is_alive():
                break
            dead = self._dead_reason_settled() or self.hung()
            if dead is not None:
                raise self._error(f"{dead} while serving {method} {path}")
            if time.monotonic() >= deadline:
                raise self._error(f"did not answer {method} {path} within {timeout:.0f} s")
        if "error" in result:
            self._call_failed = time.monotonic()
            dead = self._dead_reason_settled(connection_failed=True)
            if dead is not None:
                raise self._error(f"{dead} while serving {method} {path}") from result["error"]
            err = result["error"]
            if isinstance(err, TimeoutError) or isinstance(getattr(err, "reason", None), TimeoutError):
                raise self._error(f"did not answer {method} {path} within {timeout:.0f} s") from err
            raise self._error(f"failed {method} {path}: {err!r}") from err
        status, raw = result["response"]
        text = raw.decode(errors="replace")
        if status != 200:
            raise self._error(f"answered {method} {path} with HTTP {status}: {text[:2000]}")
        try:
            return json.loads(text) if text else None
        except json.JSONDecodeError:
            return text

    def post(self, path: str, body: Any = None, *, timeout: float | None = None) -> Any:
        out = self.call(
            "POST",
            path,
            {} if body is None else body,
            timeout=self.cfg.request_timeout_s if timeout is None else timeout,
        )
        if isinstance(out, dict) and out.get("success") is False:
            raise self._error(f"refused POST {path}: {out.get('message')}")
        return out


_LIVE_SERVERS: weakref.WeakSet[SGLangServer] = weakref.WeakSet()


@atexit.register
def _shutdown_live_servers() -> None:
    """Never leave a server running after the trainer exits (it would hold a core and RAM)."""
    for server in list(_LIVE_SERVERS):
        with suppress(Exception):
            server.shutdown()
