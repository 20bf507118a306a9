"""megatron-core's jit fuser is disabled on a CPU-only PyTorch (megatron_dapo/eager_fuser.py), kept on a CUDA one."""

import importlib.util
import subprocess
import sys

import torch

from megatron_dapo.eager_fuser import JIT_MODULE, EagerFuserFinder, cpu_only_torch


def test_importing_megatron_core_after_us_compiles_nothing():
    probe = ("import sys, megatron_dapo, megatron.core, torch; from megatron.core import jit; "
             "print(jit.jit_fuser is jit.noop_decorator, 'torch._inductor.compile_fx' in sys.modules)")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", probe], capture_output=True, text=True, check=True)
    eager, inductor = out.stdout.split()
    assert (eager, inductor) == (("True", "False") if cpu_only_torch() else ("False", "True"))


def _load_jit_through_the_finder():
    import megatron.core

    spec = EagerFuserFinder().find_spec(JIT_MODULE, megatron.core.__path__)
    assert spec is not None and spec.origin.endswith("jit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_cuda_build_keeps_torch_compile(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert _load_jit_through_the_finder().jit_fuser is torch.compile


def test_a_cpu_build_runs_the_functions_eagerly(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    module = _load_jit_through_the_finder()
    assert module.jit_fuser is module.noop_decorator


def test_other_modules_are_not_touched():
    assert EagerFuserFinder().find_spec("megatron.core.utils", None) is None
