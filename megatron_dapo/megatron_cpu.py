"""Run megatron-core (0.16) on a machine without CUDA: gloo, fp32, CPU tensors.

megatron-core hard-codes CUDA in a few places (`torch.cuda.current_device()`, `device="cuda"` in the
schedules, `torch.cuda.synchronize()`, optimizers checking `param.type()`...). `enable()` redirects
exactly those, and only when CUDA is absent; on a CUDA machine it does nothing. Each patch names the
megatron-core call that needs it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_ENABLED = False
_LOCK = threading.Lock()


def _to_cpu_device(device: Any) -> Any:
    """Map 'cuda', 'cuda:N', torch.device('cuda') and bare ints (CUDA ordinals) to cpu."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


_IDENTITY = {torch.Tensor.cuda, torch.Tensor.pin_memory}
_BACKWARD = {torch.autograd.backward, torch.Tensor.backward}


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites `device=` arguments and `.cuda()` / `.to('cuda')` calls to the CPU.

    Needed by: schedules (`torch.tensor(..., device="cuda")` for total_num_tokens), default causal
    masks, `weight.data.cuda()` in embedding setup, TP gathers and DDP/optimizer buffers allocated on
    `torch.cuda.current_device()`. A TorchFunctionMode is thread-local: `enable()` installs it
    in the calling thread; call `enter_thread()` in any other thread that runs Megatron code.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _IDENTITY:
            return args[0]
        if func in _BACKWARD:  # torch 2.13's backward() dispatches here, and a mode is off while its handler runs:
            with self:  # the backward pass's CUDA allocations (sequence parallelism's reduce-scatter, the MoE
                return _backward(func, *args, **kwargs)  # all-to-all's) would miss it
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Optimizers and grad clipping assert `param.type() == 'torch.cuda.FloatTensor'`.
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if func is torch.Tensor.to:  # (new_empty's positional arguments are sizes: its device is a keyword)
            args = tuple(_to_cpu_device(a) if i > 0 else a for i, a in enumerate(args))
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


def _backward(func, tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None, gradient=None):
    """torch.autograd.backward (or Tensor.backward, whose `gradient` is `grad_tensors`) past its __torch_function__
    check, which would dispatch to the mode again."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    grad_tensors = gradient if gradient is not None else grad_tensors
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    inputs = () if inputs is None else (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(grad_tensors, len(tensors)), is_grads_batched=False)
    _engine_run_backward(tensors, grads, create_graph if retain_graph is None else retain_graph, create_graph, inputs,
                         allow_unreachable=True, accumulate_grad=True)


_MODE: CudaToCpuMode | None = None
_THREAD_STATE = threading.local()


def needed() -> bool:
    return not torch.cuda.is_available()


def enable() -> bool:
    """Apply the CPU redirections (idempotent). Returns True if anything was patched."""
    global _ENABLED, _MODE
    if not needed():
        return False
    with _LOCK:
        if not _ENABLED:
            _patch_torch_cuda()
            _patch_megatron()
            _MODE = CudaToCpuMode()
            _ENABLED = True
    enter_thread()
    return True


def enter_thread() -> None:
    """Activate the cuda->cpu device mode in the current thread (once per thread)."""
    if _MODE is None or getattr(_THREAD_STATE, "entered", False):
        return
    _MODE.__enter__()
    _THREAD_STATE.entered = True


def is_enabled() -> bool:
    return _ENABLED


def _patch_torch_cuda() -> None:
    # current_device(): memory buffers, TP gathers, DDP grad buffers, optimizer state placement.
    torch.cuda.current_device = lambda: 0
    # synchronize(): p2p communication, the checkpoint writer, timers.
    torch.cuda.synchronize = lambda *a, **k: None
    # get_rng_state()/manual_seed(): model_parallel_cuda_manual_seed and the RNG tracker.
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.get_rng_state_all = lambda: [torch.get_rng_state()]
    torch.cuda.set_rng_state = lambda state, *a, **k: None
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.manual_seed_all = lambda seed: None
    # empty_cache()/memory stats: called by offloading and reporting paths.
    torch.cuda.empty_cache = lambda: None
    torch.cuda.memory_allocated = lambda *a, **k: 0
    torch.cuda.max_memory_allocated = lambda *a, **k: 0
    # Streams/events: the MoE all-to-all token dispatcher copies its split sizes to the host on a
    # side stream and waits on an event. On the CPU everything runs in order: no-op streams.
    torch.cuda.Stream = _HostStream
    torch.cuda.current_stream = lambda *a, **k: _HOST_STREAM
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()


class _HostEvent:
    def synchronize(self) -> None:
        pass

    def wait(self, *a, **k) -> None:
        pass


class _HostStream:
    """A stand-in for torch.cuda.Stream where work is synchronous."""

    def __init__(self, *a, **k) -> None:
        pass

    def wait_stream(self, *a, **k) -> None:
        pass

    def wait_event(self, *a, **k) -> None:
        pass

    def record_event(self, *a, **k) -> _HostEvent:
        return _HostEvent()

    def synchronize(self) -> None:
        pass


_HOST_STREAM = _HostStream()


def _patch_megatron() -> None:
    from megatron.core.tensor_parallel import random as mp_random

    # The CUDA RNG tracker forks CUDA generator states; on CPU we seed with the inference tracker
    # (no forking, dropout must be 0) and make the raw state helpers harmless.
    mp_random._set_cuda_rng_state = lambda *a, **k: None
    mp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    _patch_moe_split_sizes()


def _patch_moe_split_sizes() -> None:
    """The MoE all-to-all dispatcher turns its split sizes into host numpy arrays only when they live on
    the GPU, and torch.distributed's all_to_all_single refuses CPU tensors as split sizes."""
    from megatron.core.transformer.moe import token_dispatcher

    to_host = token_dispatcher.maybe_move_tensor_to_cpu

    def to_host_numpy(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_host_numpy
