"""megatron-core's jit fuser on a PyTorch built without CUDA or ROCm: its functions run eagerly.

megatron-core decorates a dozen small functions with `megatron.core.jit.jit_fuser` (`torch.compile`) as it
imports them. The decoration alone imports TorchDynamo and Inductor: 2.3 s of CPU in every process that
imports megatron-core (6 s in all, with torch's own 1.9 s), which on CPU is most of what a short worker
process does. Inductor would compile those functions for a CPU nobody tunes it for, and our model spec turns
off the fusions that would call most of them. So on a CPU-only build of PyTorch, megatron-core's own
`disable_jit_fuser()` runs the moment `megatron.core.jit` is imported, before any module takes `jit_fuser`
from it. A CUDA or ROCm build keeps megatron-core's default.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

JIT_MODULE = "megatron.core.jit"


def cpu_only_torch() -> bool:
    """Whether the installed PyTorch was built without CUDA and ROCm (torch is imported by then)."""
    import torch

    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


class _DisableOnLoad(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        if cpu_only_torch():
            module.disable_jit_fuser()


class EagerFuserFinder(importlib.abc.MetaPathFinder):
    """Finds `megatron.core.jit` as Python would, and disables its fuser once loaded (CPU-only PyTorch)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _DisableOnLoad(spec.loader)
        return spec


def install() -> None:
    """Put the finder first on sys.meta_path (once); no effect if megatron-core is already imported."""
    if JIT_MODULE not in sys.modules and not any(isinstance(f, EagerFuserFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, EagerFuserFinder())
