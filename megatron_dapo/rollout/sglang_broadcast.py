"""Several SGLang servers updated by ONE broadcast per bucket.

With one process group per server, rank 0 would send the whole model once per remote server and
step. Here all servers join one group (rank 0 = this process, then each server's TP ranks at its
`rank_offset`), every bucket is announced to all of them (/update_weights_from_distributed) and
broadcast once: NCCL pipelines a broadcast, so rank 0 sends about one model per step whatever the
number of servers. Generation, sleep/wake, abort and health go to the servers as an `EngineGroup`.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from datetime import timedelta
from typing import Any

import torch

from megatron_dapo.rollout.base import EngineStateError, RolloutEngine
from megatron_dapo.rollout.engine_group import EngineGroup
from megatron_dapo.rollout.sglang_engine import SGLangEngine, WeightUpdateStats, free_port
from megatron_dapo.rollout.sglang_wire import (
    _init_custom_process_group,
    alongside,
    broadcast_payload,
    iter_buckets,
)

_GROUP_IDS = itertools.count()


class BroadcastServers(EngineGroup):
    """`servers` (attached or not) whose weight updates share one broadcast group led by this process
    at `trainer_host` (an address every server can reach)."""

    def __init__(self, servers: list[SGLangEngine], trainer_host: str) -> None:
        super().__init__(servers)
        self.servers = servers
        self.url = " + ".join(s.url for s in servers)
        self.trainer_host = trainer_host
        self._pg: Any = None
        self._pg_name = ""
        self._versions = itertools.count(1)
        self.last_update = WeightUpdateStats(transport="broadcast")
        first = servers[0]
        self.device = first.device
        self.bucket_bytes = first.bucket_bytes
        self._timeout_s = min(first.cfg.request_timeout_s, 600)

    def _each(self, call: Callable[[SGLangEngine], Any]) -> None:
        """`call` on every server at once; the first failure is raised."""
        with ThreadPoolExecutor(max_workers=len(self.servers)) as pool:
            for fut in [pool.submit(call, s) for s in self.servers]:
                fut.result()

    def _ensure_group(self) -> None:
        if self._pg is not None:
            return
        backend = "nccl" if self.device == "cuda" else "gloo"
        port = free_port(self.trainer_host)
        world = 1 + sum(s.cfg.tensor_parallel for s in self.servers)
        name = f"megatron_dapo_{os.getpid()}_bcast{next(_GROUP_IDS)}"
        offsets = itertools.accumulate([1] + [s.cfg.tensor_parallel for s in self.servers])
        calls = []
        for server, offset in zip(self.servers, offsets):
            body = {"master_address": self.trainer_host, "master_port": port, "rank_offset": offset,
                    "world_size": world, "group_name": name, "backend": backend}
            calls.append(lambda s=server, b=body: s._post("/init_weights_update_group", b))
        timeout = timedelta(seconds=self._timeout_s)
        self._pg = alongside(calls, lambda: _init_custom_process_group(
            backend, self.trainer_host, port, world, 0, name, timeout))
        self._pg_name = name

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream HF-named tensors to every server: one broadcast per bucket, then flush their caches."""
        if self.device == "cuda" and any(s._asleep for s in self.servers):
            raise EngineStateError(f"SGLang servers {self.url}: wake() them before update_weights()")
        checked = self.servers[0]._checked(named_tensors)  # same checkpoint: same names and shapes
        version = str(next(self._versions))
        stats = WeightUpdateStats(transport="broadcast")
        start = time.perf_counter()
        device = torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" else torch.device("cpu")
        self._ensure_group()
        self._each(lambda s: s._post("/begin_weight_update", {}))
        try:
            for bucket in iter_buckets(checked, self.bucket_bytes):
                meta, tensors = broadcast_payload(bucket, device)
                body = {**meta, "group_name": self._pg_name, "flush_cache": False, "weight_version": version}
                pg = self._pg

                def broadcast(tensors: list[torch.Tensor] = tensors, pg: Any = pg) -> None:
                    for t in tensors:
                        torch.distributed.broadcast(t, src=0, group=pg)

                try:
                    alongside([lambda s=s, b=body: s._post("/update_weights_from_distributed", b)
                               for s in self.servers], broadcast)
                except BaseException:
                    self._pg = None  # a half-done collective leaves the group unusable
                    raise
                stats.add(bucket)
        except BaseException:
            for s in self.servers:  # close the sessions, but report the first error
                with suppress(Exception):
                    s._post("/end_weight_update", {}, timeout=60)
            raise
        self._each(lambda s: s._post("/end_weight_update", {}, timeout=600))
        self._each(lambda s: s._call("POST", "/flush_cache", None, timeout=600))
        stats.seconds = time.perf_counter() - start
        self.last_update = stats

    def shutdown(self) -> None:
        if self._pg is not None:
            for s in self.servers:
                with suppress(Exception):
                    s._post("/destroy_weights_update_group", {"group_name": self._pg_name}, timeout=10)
            with suppress(Exception):
                torch.distributed.destroy_process_group(self._pg)
            self._pg = None
        super().shutdown()


def as_rollout_engine(local: list[SGLangEngine], remote: list[SGLangEngine], trainer_host: str, *,
                      shared_broadcast: bool = True) -> RolloutEngine:
    """One engine over this node's servers and the attached `remote` ones (which share one broadcast
    group when there are several and `shared_broadcast`); prompts are split in proportion to the
    number of servers."""
    parts: list[RolloutEngine] = list(local)
    if len(remote) > 1 and shared_broadcast:
        parts.append(BroadcastServers(remote, trainer_host))
    else:
        parts.extend(remote)
    if len(parts) == 1:
        return parts[0]
    return EngineGroup(parts, weights=[len(p) if isinstance(p, EngineGroup) else 1 for p in parts])
