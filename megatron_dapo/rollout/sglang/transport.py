"""Moving weights into SGLang servers: the shared-memory tensor transport and the process group of the
"distributed" one.

- "tensor": a bucket is copied once into a flat buffer (shared memory on CPU: torch's file_system
  sharing strategy, with its shm manager started quietly), and the (name, view) pairs are pickled as
  sglang's MultiprocessingSerializer does, without sglang (`serialized_bucket`).
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
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any

import torch

from megatron_dapo.parallel import free_port
from megatron_dapo.rollout.sglang.server import SGLangServer
from megatron_dapo.rollout.sglang.wire import aligned_layout, broadcast_payload, flat_views
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


def serialize_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """Pickle (name, tensor) pairs like sglang's MultiprocessingSerializer(output_str=True), without sglang.

    CPU tensors are (re)placed in shared memory and pickled by file name; CUDA tensors by IPC handle.
    The caller keeps the tensors alive until the server has loaded them.
    """
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reducers on ForkingPickler)

    if any(not t.is_cuda for _, t in named):
        _start_shm_manager_quietly()
    buf = io.BytesIO()
    with _file_system_sharing():
        ForkingPickler(buf).dump(list(named))
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialized_bucket(bucket: list[tuple[str, torch.Tensor]]) -> tuple[str, list[tuple[str, torch.Tensor]]]:
    """`bucket` copied once into one flat buffer (shared memory on CPU, its device otherwise) and
    serialised for /update_weights_from_tensor: (payload, views). Keep the views alive until the server
    has loaded them."""
    offsets, total = aligned_layout(bucket)
    device = bucket[0][1].device
    if device.type == "cpu":
        _start_shm_manager_quietly()
        with _file_system_sharing():
            flat = torch.empty(total, dtype=torch.uint8).share_memory_()
    else:
        flat = torch.empty(total, dtype=torch.uint8, device=device)
    views = flat_views(flat, bucket, offsets)
    return serialize_named_tensors(views), views


# ---------------------------------------------------------------------- distributed transport (broadcast)


def _init_custom_process_group(
    backend: str, host: str, port: int, world_size: int, rank: int, group_name: str, timeout: timedelta
) -> Any:
    """A process group outside the default world (the same recipe SGLang uses on its side)."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, rank, world_size = next(rendezvous(f"tcp://{host}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
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
        port = free_port(self.trainer_host)
        world = 1 + sum(s.cfg.tensor_parallel for s in self.servers)
        name = f"megatron_dapo_{os.getpid()}_{self.servers[0].port}_{next(_GROUP_IDS)}"
        offsets = itertools.accumulate([1] + [s.cfg.tensor_parallel for s in self.servers])
        calls = []
        for server, offset in zip(self.servers, offsets):
            body = {"master_address": self.trainer_host, "master_port": port, "rank_offset": offset,
                    "world_size": world, "group_name": name, "backend": backend}
            calls.append(lambda s=server, b=body: s.post("/init_weights_update_group", b))
        timeout = timedelta(seconds=min(self.servers[0].cfg.request_timeout_s, 600))
        self.pg = alongside(calls, lambda: _init_custom_process_group(
            backend, self.trainer_host, port, world, 0, name, timeout))
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
