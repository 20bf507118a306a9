"""Moving weights into SGLang servers: the shared-memory tensor transport and the process group of the
"distributed" one.

- "tensor": a bucket is copied once into a flat buffer on its device (shared memory on CPU: torch's
  file_system sharing strategy, with its shm manager started quietly) and pickled per server TP rank for
  SGLang's load_format "flattened_bucket", as sglang's MultiprocessingSerializer does but without sglang,
  CUDA tensors named by device UUID (`flat_bucket`, `flat_payload`).
- "distributed": `WeightBroadcastGroup`, a process group outside the default world. Rank 0 is this
  process (at `trainer_host`), then each server's TP ranks at its `rank_offset`; the servers join
  inside /init_weights_update_group while we join here. Each bucket is announced to every server
  (/update_weights_from_distributed) and broadcast once (NCCL on GPU, gloo on CPU). A failure on any
  side is raised at once (`alongside`) and drops the group: a half-done collective leaves it unusable.
"""

from __future__ import annotations

import base64
import io
import itertools
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import torch

from megatron_dapo.rollout.sglang.server import SGLangServer
from megatron_dapo.rollout.sglang.wire import aligned_layout, broadcast_payload, flat_views, tensor_nbytes
from megatron_dapo.stop_signals import helpers_shielded

# --------------------------------------------------------------------- tensor transport (shared memory)


@contextmanager
def _file_system_sharing() -> Iterator[None]:
    import torch.multiprocessing as tmp

    old = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        tmp.set_sharing_strategy(old)


_SHM_MANAGER_STARTED = False


def _start_shm_manager_quietly() -> None:
    """Start torch's shm manager daemon with /dev/null as stdout/stderr.

    The file_system sharing strategy spawns `torch_shm_manager` (with the trainer's stop signals blocked: it
    must outlive a SIGTERM to the whole job), which inherits and keeps open this process's stdout/stderr; a parent that reads our output through a pipe would then wait for EOF
    as long as the SGLang server holds a segment. Spawning it once with /dev/null avoids that.
    """
    global _SHM_MANAGER_STARTED
    if _SHM_MANAGER_STARTED:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        with _file_system_sharing(), helpers_shielded():
            torch.empty(1).share_memory_()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)
    _SHM_MANAGER_STARTED = True


_DEVICE_ARG = 6
"""Where torch's CUDA tensor reduction puts the device ordinal (SGLang's _REDUCE_TENSOR_ARG_DEVICE_INDEX)."""


def device_uuid(ordinal: int) -> str:
    return str(torch.cuda.get_device_properties(ordinal).uuid)


def uuid_args(args: tuple, uuid_of: Callable[[int], str] = device_uuid) -> tuple:
    """A CUDA tensor's reduction arguments with the device named by UUID instead of this process's ordinal:
    SGLang's patched rebuild (monkey_patch_torch_reductions, applied before it unpickles) maps it to its own
    ordinal of that GPU, whatever CUDA_VISIBLE_DEVICES each side has."""
    return (*args[:_DEVICE_ARG], uuid_of(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1:])


def _reduce_tensor_by_uuid(tensor: torch.Tensor) -> tuple:
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is reductions.rebuild_cuda_tensor:
        args = uuid_args(args)
    return rebuild, args


def serialize_payload(obj: Any) -> str:
    """Pickle `obj` as sglang's MultiprocessingSerializer(output_str=True) does, without sglang, with CUDA
    tensors named by device UUID (our own pickler's dispatch table: torch's reductions stay untouched).

    CPU tensors are (re)placed in shared memory and pickled by file name; CUDA tensors by IPC handle. The
    caller keeps the tensors alive until the server has loaded them.
    """
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reducers on ForkingPickler)

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    for cls in (torch.Tensor, torch.nn.Parameter):
        pickler.dispatch_table[cls] = _reduce_tensor_by_uuid
    with _file_system_sharing():
        pickler.dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


@contextmanager
def _one_thread() -> Iterator[None]:
    """Copies of many medium tensors on the CPU: each parallel copy pays its threads' start-up (10-20 ms each
    on a busy machine, measured), while one thread already reaches the memory bandwidth."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def flat_bucket(bucket: Sequence[tuple[str, torch.Tensor]], staging: dict[str, torch.Tensor] | None = None,
                reserve: int = 0) -> tuple[torch.Tensor, list[SimpleNamespace]]:
    """`bucket` copied once into one flat uint8 buffer on its tensors' device (shared memory on CPU), and
    the metadata SGLang's FlattenedTensorBucket rebuilds the tensors from (name, shape, dtype, start_idx,
    end_idx, numel; a SimpleNamespace, which SGLang's restricted unpickler admits). Each tensor starts
    64-byte aligned, so the server views every dtype in place.

    `staging` (CPU): a shared-memory buffer of at least `reserve` bytes kept from one bucket to the next (the
    caller reuses it only once the server has loaded the previous bucket): a fresh segment costs ~10 copies'
    time in page faults. On a GPU every bucket gets a fresh buffer, freed after the load
    (release_ipc_memory)."""
    offsets, total = aligned_layout(bucket)
    device = bucket[0][1].device
    if device.type == "cpu":
        kept = None if staging is None else staging.get("cpu")
        if kept is None or kept.numel() < total:
            _start_shm_manager_quietly()
            with _file_system_sharing():
                kept = torch.empty(max(total, reserve), dtype=torch.uint8).share_memory_()
            if staging is not None:
                staging["cpu"] = kept
        flat = kept[:total]
        with _one_thread():
            flat_views(flat, bucket, offsets)
    else:
        flat = torch.empty(total, dtype=torch.uint8, device=device)
        flat_views(flat, bucket, offsets)
    meta = [SimpleNamespace(name=name, shape=torch.Size(t.shape), dtype=t.dtype, start_idx=off,
                            end_idx=off + tensor_nbytes(t), numel=tensor_nbytes(t))
            for (name, t), off in zip(bucket, offsets)]
    return flat, meta


def flat_payload(flat: torch.Tensor, meta: list[SimpleNamespace]) -> str:
    """One server TP rank's /update_weights_from_tensor payload (load_format "flattened_bucket"). Pickle it
    once per TP rank: each rank unpickles only its own, so CUDA-IPC reference counts drop cleanly."""
    return serialize_payload({"flattened_tensor": flat, "metadata": meta})


def release_ipc_memory(device: torch.device) -> None:
    """After a bucket was loaded: free the CUDA memory the servers' IPC handles held (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------- distributed transport (broadcast)


def listening_socket(host: str) -> socket.socket:
    """A socket bound to `host` on a port the OS picks, listening: the store of a weight-update group."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen()
    return sock


def init_custom_process_group(backend: str, listener: socket.socket, world_size: int, group_name: str,
                              timeout: timedelta) -> Any:
    """This process as rank 0 of a process group outside the default world (SGLang's recipe on its side).

    The store is OURS, served from `listener`: torch's `tcp://` rendezvous would build a client-only store
    under torchrun (TORCHELASTIC_USE_AGENT_STORE=True), served by nobody, and wait forever.
    """
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    host, port = listener.getsockname()[:2]
    store = torch.distributed.TCPStore(host, port, world_size, True, timeout=timeout,
                                       master_listen_fd=listener.detach(), wait_for_workers=False)
    pg, _ = _new_process_group_helper(
        world_size,
        0,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def alongside(calls: Sequence[Callable[[], Any]], local: Callable[[], Any]) -> Any:
    """Run the HTTP `calls` and `local()` at once (the sides of one collective) and return local's
    result. The first failure on any side is raised at once, not after the collective's timeout."""
    box: dict[Any, dict[str, Any]] = {}

    def run(key: Any, fn: Callable[[], Any]) -> None:
        try:
            box[key] = {"out": fn()}
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box[key] = {"error": e}

    jobs = [(k, fn) for k, fn in enumerate(calls)] + [("local", local)]
    for key, fn in jobs:
        threading.Thread(target=run, args=(key, fn), name=f"sglang-alongside-{key}", daemon=True).start()
    while True:
        for side in list(box.values()):
            if "error" in side:
                raise side["error"]
        if len(box) == len(jobs):
            return box["local"]["out"]
        time.sleep(0.002)


_GROUP_IDS = itertools.count()


class WeightBroadcastGroup:
    """Created lazily by `ensure()`; `send()` one bucket; `destroy()` on shutdown."""

    def __init__(self, servers: Sequence[SGLangServer], trainer_host: str) -> None:
        self.servers = list(servers)
        self.trainer_host = trainer_host
        self.device = self.servers[0].device
        self.pg: Any = None
        self.name = ""

    def ensure(self) -> None:
        if self.pg is not None:
            return
        backend = "nccl" if self.device == "cuda" else "gloo"
        listener = listening_socket(self.trainer_host)
        port = listener.getsockname()[1]
        world = 1 + sum(s.cfg.tensor_parallel for s in self.servers)
        name = f"megatron_dapo_{os.getpid()}_{self.servers[0].port}_{next(_GROUP_IDS)}"
        offsets = itertools.accumulate([1] + [s.cfg.tensor_parallel for s in self.servers])
        calls = []
        for server, offset in zip(self.servers, offsets):
            body = {"master_address": self.trainer_host, "master_port": port, "rank_offset": offset,
                    "world_size": world, "group_name": name, "backend": backend}
            calls.append(lambda s=server, b=body: s.post("/init_weights_update_group", b))
        timeout = timedelta(seconds=min(self.servers[0].cfg.request_timeout_s, 600))
        try:
            self.pg = alongside(calls, lambda: init_custom_process_group(backend, listener, world, name,
                                                                         timeout))
        finally:
            listener.close()  # the store holds its own descriptor (or never took it)
        self.name = name

    def send(self, bucket: list[tuple[str, torch.Tensor]], version: str) -> None:
        device = torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" else torch.device("cpu")
        meta, tensors = broadcast_payload(bucket, device)
        body = {**meta, "group_name": self.name, "flush_cache": False, "weight_version": version}
        pg = self.pg

        def broadcast() -> None:
            for t in tensors:
                torch.distributed.broadcast(t, src=0, group=pg)

        try:
            alongside([lambda s=s: s.post("/update_weights_from_distributed", body) for s in self.servers],
                      broadcast)
        except BaseException:
            self.pg = None
            raise

    def destroy(self) -> None:
        """Leave the group (telling the servers that still answer); idempotent."""
        if self.pg is None:
            return
        for s in self.servers:
            if s.dead_reason() is None:
                with suppress(Exception):
                    s.post("/destroy_weights_update_group", {"group_name": self.name}, timeout=10)
        with suppress(Exception):
            torch.distributed.destroy_process_group(self.pg)
        self.pg = None
