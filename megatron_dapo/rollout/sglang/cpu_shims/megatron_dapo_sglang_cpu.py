"""Loaded by a .pth file in the SGLang venv: activate megatron-dapo's CPU shims for SGLang, lazily.

Cheap at start-up (no torch import here). Active only when SGLANG_USE_CPU_ENGINE=1; the CUDA check runs
when `sgl_kernel` or `sglang` is first imported. See megatron_dapo/rollout/sglang/cpu_shims/__init__.py.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

STANDIN_MODULE = "megatron_dapo_sgl_kernel_cpu_standin"


def _cuda_absent() -> bool:
    import torch

    return not torch.cuda.is_available()


def patch_device_module() -> None:
    """Make a bare `torch.get_device_module()` return torch.cpu (keeps `__wrapped__`)."""
    import torch

    original = torch.get_device_module
    if getattr(original, "_megatron_dapo_cpu_patch", False):
        return

    @functools.wraps(original)
    def get_device_module(device=None):
        if device is None:
            return torch.cpu
        return original(device)

    get_device_module._megatron_dapo_cpu_patch = True
    torch.get_device_module = get_device_module


class _CpuShimFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._patched = False
        self._busy = False

    def find_spec(self, fullname, path=None, target=None):
        if self._busy or fullname not in ("sglang", "sgl_kernel"):
            return None
        self._busy = True  # the checks below import torch; do not re-enter for it
        try:
            if not _cuda_absent():
                return None
            if not self._patched:
                patch_device_module()
                self._patched = True
            if fullname == "sglang":
                return None  # the real sglang loads normally; we only needed the patch first
            if importlib.machinery.PathFinder.find_spec("sgl_kernel") is not None:
                return None  # a real sgl_kernel build is installed: use it
            origin = importlib.util.find_spec(STANDIN_MODULE).origin
            loader = importlib.machinery.SourceFileLoader("sgl_kernel", origin)
            return importlib.util.spec_from_file_location("sgl_kernel", origin, loader=loader)
        finally:
            self._busy = False


def install() -> None:
    if os.environ.get("SGLANG_USE_CPU_ENGINE", "0") != "1":
        return
    if not any(isinstance(f, _CpuShimFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _CpuShimFinder())
