"""The sandbox against hostile snippets: network, files, environment, processes, memory, time, output, fork, disk.

Each test runs a real bubblewrap sandbox. Where bwrap is missing the tests are skipped with the sandbox's own
refusal, except under CI (CI=true: .ci/run installs it first), where that is a failure.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from megatron_dapo.sandbox import (SandboxConfig, SandboxPool, SandboxUnavailable, ToolResult, check_sandbox,
                                   run_code)
from megatron_dapo.sandbox.bwrap import ENV, PROJECT

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def sandbox_here():
    try:
        check_sandbox(SandboxConfig())
    except SandboxUnavailable as e:
        if os.environ.get("CI"):
            pytest.fail(str(e))
        pytest.skip(str(e))


def run(code: str, **limits) -> ToolResult:
    return run_code(textwrap.dedent(code), SandboxConfig(**{"timeout_s": 10.0, **limits}))


def processes_running(marker: str) -> list[int]:
    """Host pids whose command line holds `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


def test_ok_error_and_the_traceback():
    ok = run("print('hello', 6 * 7)")
    assert (ok.status, ok.stdout, ok.stderr, ok.exit_code) == ("ok", "hello 42\n", "", 0)
    bad = run("import sys\nprint('before')\n1 / 0")
    assert bad.status == "error" and bad.exit_code == 1 and bad.stdout == "before\n"
    assert "ZeroDivisionError" in bad.stderr and 'File "/sandbox/main.py", line 3' in bad.stderr
    assert run("raise SystemExit(3)").exit_code == 3


def test_network_loopback_and_outside_are_unreachable():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    r = run(f"""
        import socket
        for addr in (("127.0.0.1", {port}), ("10.255.255.1", 80)):
            try:
                socket.create_connection(addr, timeout=1).close()
                print("connected", addr)
            except OSError as e:
                print("refused", type(e).__name__)
        """)
    with pytest.raises(TimeoutError):  # nothing reached the trainer's loopback
        listener.accept()
    listener.close()
    assert r.status == "ok" and "connected" not in r.stdout and r.stdout.count("refused") == 2
    assert r.seconds < 5


def test_project_training_data_and_host_files_are_invisible(tmp_path):
    answers = tmp_path / "train.jsonl"
    answers.write_text('{"answer": 42}\n')
    r = run(f"""
        import os
        for p in {[str(PROJECT), str(REPO), str(answers), str(tmp_path), "/etc/passwd", "/root/.ssh", "/work"]!r}:
            print(p, os.path.exists(p))
        print("tmp", os.listdir("/tmp"))
        """)
    assert r.status == "ok"
    seen = [line for line in r.stdout.splitlines() if line.endswith(" True")]
    assert seen == [] and "tmp []" in r.stdout
    assert answers.read_text() == '{"answer": 42}\n'


def test_writes_outside_tmp_fail():
    exe_dir = os.path.dirname(os.path.realpath(sys.executable))
    r = run(f"""
        for p in ("/x", "/usr/x", "/proc/x", {exe_dir + "/x"!r}, "/sandbox/main.py"):
            try:
                open(p, "w").write("pwned")
                print("wrote", p)
            except OSError as e:
                print("denied", p)
        open("/tmp/fine", "w").write("ok")
        print("tmp ok")
        """)
    assert r.status == "ok" and "wrote" not in r.stdout and r.stdout.count("denied") == 5 and "tmp ok" in r.stdout
    assert not os.path.exists(exe_dir + "/x")


def test_the_environment_is_not_the_trainers(monkeypatch):
    monkeypatch.setenv("MEGATRON_DAPO_SECRET", "hunter2")
    r = run("import os, json; print(json.dumps(dict(os.environ)))")
    env = json.loads(r.stdout)
    assert "MEGATRON_DAPO_SECRET" not in env and "hunter2" not in r.stdout
    assert set(env) <= set(ENV) | {"PWD"}  # bwrap sets PWD for --chdir


def test_trainer_processes_are_invisible_and_unsignalable():
    r = run(f"""
        import os, signal
        print("uid", os.getuid(), os.getgid(), os.getgroups())
        print("pids", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
        status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines())
        print("caps", status["CapEff"].strip(), status["CapPrm"].strip(), "nnp", status["NoNewPrivs"].strip())
        for pid in ({os.getpid()}, {os.getppid()}, 1):
            try:
                os.kill(pid, signal.SIGTERM if pid != 1 else 0)
                print("signalled", pid)
            except OSError as e:
                print("no", pid, type(e).__name__)
        """)
    assert r.status == "ok", r.stderr
    assert "uid 65534 65534 []" in r.stdout
    assert "caps 0000000000000000 0000000000000000 nnp 1" in r.stdout
    pids = json.loads(r.stdout.split("pids ")[1].splitlines()[0])
    assert os.getpid() not in pids and len(pids) <= 3  # bwrap's init, the snippet, maybe its launcher
    assert f"no {os.getpid()}" in r.stdout and f"no {os.getppid()}" in r.stdout


def test_memory_bomb_fails_inside_the_limit():
    r = run("x = bytearray(4 << 30)\nprint('allocated')", memory_mb=256)
    assert r.status == "error" and "MemoryError" in r.stderr and "allocated" not in r.stdout


def test_infinite_loop_times_out_on_the_wall_clock():
    r = run("while True:\n    pass", timeout_s=1.0)
    assert r.status == "timeout" and "wall time" in r.reason and r.exit_code is None
    assert 1.0 <= r.seconds < 3.0 and "[sandbox: timeout" in r.stderr


def test_cpu_limit_stops_a_busy_loop_before_the_wall_clock():
    r = run("while True:\n    pass", timeout_s=60.0, cpu_s=1.0)  # the wall clock is far; on a busy machine
    assert r.status == "timeout" and r.reason == "cpu time 1 s" and r.exit_code == 128 + 24  # SIGXCPU


def test_output_flood_is_truncated_and_killed():
    r = run("import sys\nwhile True:\n    sys.stdout.write('x' * 4096)", max_output_bytes=10000)
    assert r.status == "killed" and r.reason == "output limit 10000 bytes"
    assert r.stdout == "x" * 10000 and r.seconds < 5


def test_fork_bomb_is_bounded_and_dies_with_the_sandbox():
    marker = uuid.uuid4().hex  # on the children's command lines, so the host can look for them
    code = f"""
import os, sys, time
n = 0
try:
    for _ in range(500):
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-S", "-c", "import time; time.sleep(60)", "{marker}"])
        n += 1
except OSError as e:
    print("stopped", type(e).__name__)
print("forked", n, flush=True)
time.sleep(1.5)
"""
    seen = 0
    with SandboxPool(SandboxConfig(max_processes=16, timeout_s=20)) as pool:
        future = pool.submit(code)
        while not future.done():
            seen = max(seen, len(processes_running(marker)))
            time.sleep(0.05)
        r = future.result()
    assert r.status == "ok" and "stopped BlockingIOError" in r.stdout, r
    assert 0 < seen <= int(r.stdout.split("forked ")[1]) < 16  # the children were there, and visible from here
    time.sleep(0.2)
    assert processes_running(marker) == []  # they went with the sandbox's pid namespace


def test_disk_fill_is_bounded():
    r = run("""
        n = 0
        try:
            with open("/tmp/fill", "wb") as f:
                for _ in range(64):
                    f.write(b"x" * (1 << 20))
                    n += 1
        except OSError as e:
            print("stopped", type(e).__name__)
        print("mb", n)
        """, disk_mb=8)
    assert "stopped" in r.stdout and int(r.stdout.split("mb ")[1]) <= 8


def test_site_packages_are_a_choice():
    code = "import importlib.util; print(importlib.util.find_spec('pytest') is not None)"
    assert run(code).stdout == "True\n"
    assert run(code, site_packages=False).stdout == "False\n"


def test_cli_prints_one_json_line(tmp_path, python_env):
    snippet = tmp_path / "s.py"
    snippet.write_text("print(2 + 2)\n")
    out = subprocess.run([sys.executable, "-m", "megatron_dapo.sandbox", str(snippet), "--timeout", "5"],
                         capture_output=True, text=True, env=python_env, timeout=60)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and len(lines) == 1
    line = json.loads(lines[0])
    assert set(line) == {"status", "stdout", "stderr", "seconds"} and line["stdout"] == "4\n"


def test_pool_runs_calls_in_parallel():
    n, nap = 4, 0.8
    with SandboxPool(SandboxConfig(workers=n)) as pool:
        t0 = time.monotonic()
        futures = [pool.submit(f"import time; time.sleep({nap}); print({i})") for i in range(n)]
        submitted = time.monotonic() - t0
        results = [f.result() for f in futures]
        wall = time.monotonic() - t0
    assert submitted < nap / 2  # the caller is not blocked (one blocking call alone would take nap)
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(n)]
    assert wall < n * nap  # serially it would take at least n * nap


def test_refusal_is_one_line_and_nothing_runs_unsandboxed(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    for call in (lambda: run_code("print(1)"), lambda: SandboxPool(SandboxConfig())):
        with pytest.raises(SandboxUnavailable) as e:
            call()
        assert "apt-get install -y bubblewrap" in str(e.value) and "\n" not in str(e.value)


def test_config_rejects_nonsense():
    with pytest.raises(ValueError, match="sandbox.timeout_s must be > 0"):
        SandboxConfig(timeout_s=0)
    with pytest.raises(ValueError, match="sandbox.max_processes must be > 0"):
        SandboxConfig(max_processes=0)


NON_ROOT_CALLER = """
from megatron_dapo.sandbox import SandboxConfig, run_code
code = "import os\\nn = 0\\ntry:\\n    while os.fork():\\n        n += 1\\nexcept OSError:\\n    print(os.getuid(), n, os.path.exists('/work'))"
print(run_code(code, SandboxConfig(max_processes=8, site_packages=False)).stdout, end="")
"""


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"), reason="needs root to become uid "
                    "65534 and a world-readable /usr/bin/python3")
def test_a_non_root_caller_gets_the_same_limits(tmp_path):
    """The other path of bwrap.launch: the trainer as uid 65534 (bwrap's own --unshare-user)."""
    as_nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "env", f"PYTHONPATH={REPO}",
                 "HOME=/tmp", "/usr/bin/python3"]
    if subprocess.run([*as_nobody, "-c", "import megatron_dapo.sandbox"], cwd="/", capture_output=True).returncode:
        pytest.skip(f"uid 65534 cannot import the package from {REPO}")
    out = subprocess.run([*as_nobody, "-c", NON_ROOT_CALLER], cwd="/", capture_output=True, text=True, timeout=60)
    uid, forked, sees_work = out.stdout.split()
    assert (uid, sees_work) == ("65534", "False") and int(forked) < 8, out.stderr


def test_a_bind_over_the_project_is_refused():
    from megatron_dapo.sandbox.bwrap import refuse_covering
    for path in (PROJECT, PROJECT.parent, Path("/")):
        with pytest.raises(SandboxUnavailable, match="would expose the project"):
            refuse_covering(str(path))
    refuse_covering(str(PROJECT / "megatron_dapo"))  # inside it, not covering it: bwrap.mounts never binds that
