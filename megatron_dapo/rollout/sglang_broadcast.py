"""Several SGLang servers updated by ONE broadcast per bucket.

With one process group per server, rank 0 would send the whole model once per remote server and
step. Here all servers join one group (rank 0 = this process, then each server's TP ranks at its
`rank_offset`), every bucket is announced to all of them (/update_weights_from_distributed) and
broadcast once: NCCL pipelines a broadcast, so rank 0 sends about one model per step whatever the
number of servers. Generation, sleep/wake, abort and health go to the servers as an `EngineGroup`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from contextlib import suppress

import torch

from megatron_dapo.rollout.base import EngineStateError, RolloutEngine
from megatron_dapo.rollout.engine_group import EngineGroup
from megatron_dapo.rollout.sglang_engine import SGLangEngine, WeightUpdateStats
from megatron_dapo.rollout.sglang_weight_group import WeightBroadcastGroup
from megatron_dapo.rollout.sglang_wire import iter_buckets


class BroadcastServers(EngineGroup):
    """`servers` (attached or not) whose weight updates share one broadcast group led by this process
    at `trainer_host` (an address every server can reach)."""

    def __init__(self, servers: list[SGLangEngine], trainer_host: str) -> None:
        super().__init__(servers)
        self.servers = servers
        self.url = " + ".join(s.url for s in servers)
        self._group = WeightBroadcastGroup(servers, trainer_host)
        self._versions = itertools.count(1)
        self.last_update = WeightUpdateStats(transport="broadcast")
        self.bucket_bytes = servers[0].bucket_bytes

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream HF-named tensors to every server: one broadcast per bucket, then flush their caches."""
        if self._group.device == "cuda" and any(s._asleep for s in self.servers):
            raise EngineStateError(f"SGLang servers {self.url}: wake() them before update_weights()")
        checked = self.servers[0]._checked(named_tensors)  # same checkpoint: same names and shapes
        version = str(next(self._versions))
        stats = WeightUpdateStats(transport="broadcast")
        start = time.perf_counter()
        self._group.ensure()
        self._all(lambda s: s._post("/begin_weight_update", {}), "begin_weight_update")
        try:
            for bucket in iter_buckets(checked, self.bucket_bytes):
                self._group.send(bucket, version)
                stats.add(bucket)
        except BaseException:
            for s in self.servers:  # close the sessions, but report the first error
                with suppress(Exception):
                    s._post("/end_weight_update", {}, timeout=60)
            raise
        self._all(lambda s: s._post("/end_weight_update", {}, timeout=600), "end_weight_update")
        self._all(lambda s: s._call("POST", "/flush_cache", None, timeout=600), "flush_cache")
        stats.seconds = time.perf_counter() - start
        self.last_update = stats

    def shutdown(self) -> None:
        self._group.destroy()
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
