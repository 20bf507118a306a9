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


WEIGHT_UPDATER = "sglang.srt.managers.scheduler_components.weight_updater"


def lose_released_memory(module) -> None:
    """Make /release_memory_occupation lose what CUDA's memory saver loses: the content of every released
    region -- the weights (unless --enable-weights-cpu-backup) and the KV cache -- comes back as NaN. Without
    this the CPU engine's release is a no-op, and a trainer that generates from weights it never synced
    again after a release passes on CPU and rolls out from garbage on a GPU."""
    import torch

    cls = module.SchedulerWeightUpdaterManager
    if getattr(cls.release_memory_occupation, "_megatron_dapo_cpu_patch", False):
        return
    original = cls.release_memory_occupation

    @functools.wraps(original)
    def release_memory_occupation(self, recv_req):
        out = original(self, recv_req)
        tags = recv_req.tags or module.GPU_MEMORY_ALL_TYPES
        runner = self.tp_worker.model_runner
        lost = []
        if module.GPU_MEMORY_TYPE_WEIGHTS in tags and not _weights_backup():
            lost += [p for p in runner.model.parameters() if p.is_floating_point()]
        if module.GPU_MEMORY_TYPE_KV_CACHE in tags:
            pool = runner.token_to_kv_pool
            lost += [t for name in ("k_buffer", "v_buffer", "kv_buffer") for t in (getattr(pool, name, None) or [])]
        with torch.no_grad():
            for t in lost:
                t.fill_(float("nan"))
        return out

    release_memory_occupation._megatron_dapo_cpu_patch = True
    cls.release_memory_occupation = release_memory_occupation


HOST_POOL = "sglang.srt.mem_cache.pool_host.common"


def register_nothing(module) -> None:
    """`--enable-return-routed-experts` (rollout routing replay, r3) keeps the routes in a pinned host buffer that
    SGLang registers with cudaHostRegister; on the CPU engine there is no device to pin for, and the call needs a
    CUDA driver. The buffer is plain host memory, as registration only speeds a device's copies into it."""
    original = module._cuda_host_register
    if getattr(original, "_megatron_dapo_cpu_patch", False):
        return

    @functools.wraps(original)
    def _cuda_host_register(buffer, registration_granularity_bytes=None):
        return None

    _cuda_host_register._megatron_dapo_cpu_patch = True
    module._cuda_host_register = _cuda_host_register


def _weights_backup() -> bool:
    from sglang.srt.runtime_context import get_exec

    return bool(get_exec().features.enable_weights_cpu_backup)


class _PatchAfterLoad(importlib.abc.Loader):
    def __init__(self, loader, patch) -> None:
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.patch(module)


class _CpuShimFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._patched = False
        self._busy = False

    def find_spec(self, fullname, path=None, target=None):
        if self._busy or fullname not in ("sglang", "sgl_kernel", WEIGHT_UPDATER, HOST_POOL):
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
            if fullname in (WEIGHT_UPDATER, HOST_POOL):
                spec = importlib.machinery.PathFinder.find_spec(fullname, path)
                if spec is not None:
                    patch = lose_released_memory if fullname == WEIGHT_UPDATER else register_nothing
                    spec.loader = _PatchAfterLoad(spec.loader, patch)
                return spec
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
