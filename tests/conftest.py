import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

# Triton decides interpreter mode when it is first imported (its tl.* helpers are @jit functions),
# and transformers / megatron-core import it early: without CUDA, choose the interpreter up front so
# the kernel tests can run the Triton kernels on CPU whatever test imported triton first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# .ci/run's cache of built bases serves README command 1; the tests build (or stub) their own bases.
os.environ.pop("MEGATRON_DAPO_BASE_CACHE", None)


def pytest_collection_modifyitems(config, items):
    """`gpu` tests only run where CUDA exists; elsewhere they are reported as skipped, never silent. A test that
    starts a real SGLang server (the sglang_python fixture) must be in the sglang tier (or gpu): else it would
    build the server's venv inside the CPU tier."""
    unmarked = [item.nodeid for item in items if "sglang_python" in getattr(item, "fixturenames", ())
                and not any(m in item.keywords for m in ("sglang", "gpu"))]
    if unmarked:
        raise pytest.UsageError("real SGLang server without the sglang marker: " + ", ".join(unmarked))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu tier)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def repo_root() -> Path:
    return REPO


@pytest.fixture
def python_env() -> dict:
    """Environment for subprocesses: the repo importable, quiet threads."""
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.fixture(scope="module")
def env() -> dict:
    """Environment for subprocesses, for module-scoped fixtures too: the repo importable, one thread."""
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "OMP_NUM_THREADS": "1"}


PYTHON = sys.executable


@pytest.fixture(scope="module")
def one_thread():
    """For a module of tiny models (`pytestmark = pytest.mark.usefixtures("one_thread")`): they gain nothing
    from intra-op threads, and lose a lot to a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """The tests' one tiny-model factory: `tiny_hf("qwen3", tied=True, vocab_size=100, seed=1)` saves a
    random HF model (megatron_dapo.tiny.save_tiny_model) into a fresh temporary folder and returns it."""
    from megatron_dapo.tiny import save_tiny_model

    def make(family: str = "qwen2", **kw) -> Path:
        return save_tiny_model(tmp_path_factory.mktemp(family), family, **kw)

    return make

@pytest.fixture(scope="session")
def base_dir(tmp_path_factory) -> Path:
    """The tiny arithmetic base (8 s of pre-training), built once per test session and shared read-only
    by every module that trains from it. Under xdist one worker builds it (a file lock) while the others wait:
    built by two at once, each would get half the cores for its 8 s and come out weaker."""
    from megatron_dapo.tiny import ensure_tiny_base

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, above each worker's own
    return ensure_tiny_base(root / "shared_base" / "tiny_base", seconds=8)


# SGLang fixtures (fake server executable, the real server's venv, tiny checkpoints) for every module.
from sglang_support import fake_exe, fake_python, hf, models, sglang_python  # noqa: E402, F401


# ---- No test leaves a process behind ------------------------------------------------------------
# Every process the suite starts inherits _SESSION_MARK (= pytest's pid) through its environment, so
# it is found at the end even when its parent died and it was re-parented to init. A process still
# alive when the session's fixtures are all torn down is a leak: the run fails, listing and killing it.
import psutil  # noqa: E402

_SESSION_MARK = "MEGATRON_DAPO_TEST_SESSION"
os.environ[_SESSION_MARK] = str(os.getpid())
# Helpers a process starts once for itself and that exit with it: allowed while pytest is their parent.
_EXITS_WITH_PARENT = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "torch_shm_manager")
_first_seen: dict[int, tuple[psutil.Process, str]] = {}  # pid -> (process, the test it appeared in)
_checked_pids: set[int] = set()


def _marked(proc: psutil.Process) -> bool:
    try:
        return proc.environ().get(_SESSION_MARK) == str(os.getpid()) and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, OSError):
        return False


def _note_new_processes(nodeid: str) -> None:
    """Remember which test each of the suite's processes first appeared in (read once per new pid)."""
    for pid in set(psutil.pids()) - _checked_pids:
        _checked_pids.add(pid)
        try:
            proc = psutil.Process(pid)
        except psutil.Error:
            continue
        if pid != os.getpid() and _marked(proc):
            _first_seen[pid] = (proc, nodeid)


def pytest_runtest_logfinish(nodeid, location):
    _note_new_processes(nodeid)


def _leftover_processes() -> list[psutil.Process]:
    me = os.getpid()
    found = {p.pid: p for p in psutil.Process(me).children(recursive=True)}
    found.update((p.pid, p) for p in psutil.process_iter() if p.pid != me and _marked(p))
    alive = []
    for proc in found.values():
        try:
            if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(proc.cmdline())
            if proc.ppid() == me and any(name in cmd for name in _EXITS_WITH_PARENT):
                continue
            alive.append(proc)
        except psutil.Error:
            continue
    return alive


def _describe(proc: psutil.Process) -> str:
    seen = _first_seen.get(proc.pid)
    where = f"first seen after {seen[1]}" if seen and seen[0] == proc else "started in an unknown test"
    try:
        return f"pid {proc.pid} (parent {proc.ppid()}, {where}): {' '.join(proc.cmdline())[:300]}"
    except psutil.Error:
        return f"pid {proc.pid} ({where})"


@pytest.fixture(scope="session", autouse=True)
def no_leaked_processes():
    """Set up first, torn down last: after every other fixture of the session has cleaned up."""
    yield
    leftovers = _leftover_processes()
    _, still_alive = psutil.wait_procs(leftovers, timeout=10)  # grace: some are on their way out
    if not still_alive:
        return
    report = "\n".join(_describe(p) for p in still_alive)
    for proc in still_alive:
        try:
            for p in [*proc.children(recursive=True), proc]:
                p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(still_alive, timeout=10)
    pytest.fail(f"after all tests (not this one alone), {len(still_alive)} process(es) of the session "
                f"were still running (now killed):\n{report}")
