"""The SGLang servers of a job: start the configured ones (one `SGLangEngine`, or several behind an
`EngineGroup`); in a multi-node job, servers on every node (`start_job_servers`), the other nodes'
attached to rank 0 and updated by one shared broadcast (`BroadcastServers`).

BroadcastServers: with one process group per server, rank 0 would send the whole model once per remote
server and step. Here all servers join one group (rank 0 = this process, then each server's TP ranks
at its `rank_offset`), every bucket is announced to all of them (/update_weights_from_distributed) and
broadcast once: NCCL pipelines a broadcast, so rank 0 sends about one model per step whatever the
number of servers. Generation, sleep/wake, abort and health go to the servers as an `EngineGroup`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import secrets
import socket
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.config import SGLangConfig
from megatron_dapo.rollout.base import EngineStateError, RolloutEngine
from megatron_dapo.rollout.engine_group import EngineGroup
from megatron_dapo.rollout.sglang.engine import SGLangEngine, WeightUpdateStats
from megatron_dapo.rollout.sglang.server import SGLangServerError
from megatron_dapo.rollout.sglang.transport import WeightBroadcastGroup
from megatron_dapo.rollout.sglang.wire import iter_buckets

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------- launching


def servers_per_node(cfg: SGLangConfig) -> int:
    """cfg.num_servers, or when 0 as many TP groups as this node's visible GPUs hold (one on CPU)."""
    if cfg.num_servers:
        return cfg.num_servers
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return max(gpus // cfg.tensor_parallel, 1)


def launch_servers(model_path: str | Path, cfg: SGLangConfig, **engine_kwargs: Any) -> RolloutEngine:
    """cfg.num_servers servers (server k: port base_port + k, devices from k*TP), started together.

    The processes are spawned from the calling thread (their parent-death signal follows it) and
    waited for in parallel. If any fails to start, all are stopped and the first failure (in server
    order) is raised. `engine_kwargs` go to every `SGLangEngine` (bucket_mb, dtype, device, log_dir...).
    """
    count = servers_per_node(cfg)
    if count == 1:
        return SGLangEngine(model_path, cfg, **engine_kwargs)
    engines: list[SGLangEngine] = []
    try:
        for k in range(count):
            engines.append(SGLangEngine(model_path, cfg, server_index=k, wait=False, **engine_kwargs))
        with ThreadPoolExecutor(max_workers=len(engines)) as pool:
            futures = [pool.submit(e.wait_ready) for e in engines]
        for fut in futures:
            fut.result()
    except BaseException:
        for engine in engines:
            with suppress(Exception):
                engine.shutdown()
        raise
    return EngineGroup(engines)


@dataclass
class JobServers:
    """What `start_job_servers` leaves with a rank: the driver's engine (global rank 0 only) and the
    servers this rank started (a node leader's), which it must shut down at the end."""

    engine: RolloutEngine | None
    owned: list[SGLangEngine]

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        for server in self.owned:
            server.shutdown()


def node_address() -> str:
    """The address other nodes reach this one at: $DAPO_NODE_ADDR, else the host name's address."""
    return os.environ.get("DAPO_NODE_ADDR") or socket.gethostbyname(socket.gethostname())


def start_job_servers(model_path: str | Path, cfg: SGLangConfig, **engine_kwargs: Any) -> JobServers:
    """Called by every rank of the job (a collective). The lowest rank of each node starts cfg.num_servers
    servers there (bound to 127.0.0.1 in a one-node job, else to `node_address()`; node n's server k on
    port base_port + n * num_servers + k). Global rank 0 gets one engine over all of them: its own node's
    with cfg.weight_sync, the other nodes' attached, with weight updates broadcast over the network
    ("distributed", one shared group for all of them: BroadcastServers; "disk" stays disk). A server
    that fails to start fails every rank, naming it. The servers take one API key per job (rank 0's,
    `--api-key`), sent with every request: nothing else on the network can drive them."""
    import torch.distributed as dist

    from megatron_dapo import parallel

    env = parallel.launch_env()
    engine_kwargs.setdefault("api_key", secrets.token_urlsafe(32))  # this job's; every request carries it
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return JobServers(launch_servers(model_path, cfg, **engine_kwargs), [])
    rank, world = dist.get_rank(), dist.get_world_size()
    nodes: list[Any] = [None] * world
    dist.all_gather_object(nodes, (env.node_rank, node_address(), engine_kwargs["api_key"]))
    engine_kwargs["api_key"] = nodes[0][2]  # rank 0's key for every server of the job
    multi_node = len({n for n, _, _ in nodes}) > 1
    leader = rank == min(r for r, (n, _, _) in enumerate(nodes) if n == env.node_rank)
    host = nodes[rank][1] if multi_node else "127.0.0.1"
    owned: list[SGLangEngine] = []
    report: Any = None
    if leader:
        count = servers_per_node(cfg)
        node_cfg = dataclasses.replace(cfg, num_servers=count, base_port=cfg.base_port + env.node_rank * count)
        try:
            group = launch_servers(model_path, node_cfg, host=host, **engine_kwargs)
            owned = list(group.engines) if isinstance(group, EngineGroup) else [group]
            report = [e.url for e in owned]
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            report = f"node {env.node_rank} ({host}): {e}"
    reports: list[Any] = [None] * world
    dist.all_gather_object(reports, report)
    failures = [r for r in reports if isinstance(r, str)]
    if failures:
        for server in owned:
            server.shutdown()
        raise SGLangServerError("SGLang servers failed to start:\n" + "\n".join(failures))
    if rank != 0:
        return JobServers(None, owned)
    remote_cfg = cfg if cfg.weight_sync == "disk" else dataclasses.replace(cfg, weight_sync="distributed")
    remote: list[SGLangEngine] = []
    for r, urls in enumerate(reports):
        if urls is None or r == 0:
            continue
        for url in urls:
            remote_host, port = url.removeprefix("http://").rsplit(":", 1)
            remote.append(SGLangEngine(model_path, remote_cfg, host=remote_host, port=int(port), attach=True,
                                       trainer_host=host, **engine_kwargs))
    shared = len(remote) > 1 and remote_cfg.weight_sync == "distributed"
    log.info("SGLang servers: %s", ", ".join(
        [f"{e.url} ({e.cfg.weight_sync})" for e in owned]
        + [f"{e.url} ({'one shared broadcast' if shared else e.cfg.weight_sync}, attached)" for e in remote]))
    return JobServers(as_rollout_engine(owned, remote, host, shared_broadcast=shared), [])


# ---------------------------------------------------------------- remote servers, one broadcast


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
        if any(s.weights_released for s in self.servers):
            raise EngineStateError(f"SGLang servers {self.url}: wake() them before update_weights()")
        checked = self.servers[0].checked_weights(named_tensors)  # same checkpoint: same names and shapes
        version = str(next(self._versions))
        stats = WeightUpdateStats(transport="broadcast")
        start = time.perf_counter()
        self._group.ensure()
        self._all(lambda s: s.post("/begin_weight_update", {}), "begin_weight_update")
        try:
            for bucket in iter_buckets(checked, self.bucket_bytes):
                self._group.send(bucket, version)
                stats.add(bucket)
        except BaseException:
            for s in self.servers:  # close the sessions, but report the first error
                with suppress(Exception):
                    s.post("/end_weight_update", {}, timeout=60)
            raise
        self._all(lambda s: s.post("/end_weight_update", {}, timeout=600), "end_weight_update")
        self._all(lambda s: s.call("POST", "/flush_cache", None, timeout=600), "flush_cache")
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
