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


def pytest_collection_modifyitems(config, items):
    """`gpu` tests only run where CUDA exists; elsewhere they are reported as skipped, never silent."""
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


PYTHON = sys.executable


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """The tests' one tiny-model factory: `tiny_hf("qwen3", tied=True, vocab_size=100, seed=1)` saves a
    random HF model (megatron_dapo.tiny.save_tiny_model) into a fresh temporary folder and returns it."""
    from megatron_dapo.tiny import save_tiny_model

    def make(family: str = "qwen2", **kw) -> Path:
        return save_tiny_model(tmp_path_factory.mktemp(family), family, **kw)

    return make

# SGLang fixtures (fake server executable, the real server's venv, tiny checkpoints) for every module.
from sglang_support import fake_exe, fake_python, hf, models, sglang_python  # noqa: E402, F401
