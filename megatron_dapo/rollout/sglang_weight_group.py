"""The process group of the "distributed" weight transport, for one SGLang server or several.

Rank 0 is this process (at `trainer_host`), then each server's TP ranks at its `rank_offset`; the
servers join inside /init_weights_update_group while we join here. Each bucket is announced to every
server (/update_weights_from_distributed) and broadcast once (NCCL on GPU, gloo on CPU). A failure on
any side is raised at once (`alongside`) and drops the group: a half-done collective leaves it unusable.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from contextlib import suppress
from datetime import timedelta
from typing import Any

import torch

from megatron_dapo.rollout.sglang_server import SGLangServer, free_port
from megatron_dapo.rollout.sglang_wire import _init_custom_process_group, alongside, broadcast_payload

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
            calls.append(lambda s=server, b=body: s._post("/init_weights_update_group", b))
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
            alongside([lambda s=s: s._post("/update_weights_from_distributed", body) for s in self.servers],
                      broadcast)
        except BaseException:
            self.pg = None
            raise

    def destroy(self) -> None:
        """Leave the group (telling the servers that still answer); idempotent."""
        if self.pg is None:
            return
        for s in self.servers:
            if s._dead_reason() is None:
                with suppress(Exception):
                    s._post("/destroy_weights_update_group", {"group_name": self.name}, timeout=10)
        with suppress(Exception):
            torch.distributed.destroy_process_group(self.pg)
        self.pg = None
