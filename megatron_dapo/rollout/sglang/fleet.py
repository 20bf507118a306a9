"""The SGLang servers of a job: start the configured ones (one `SGLangEngine`, or several behind an
`EngineGroup`); in a multi-node job, servers on every node (`start_job_servers`), the other nodes'
attached to rank 0 for generation, sleep/wake, abort and health.

Weights never go through rank 0: every node's servers take them from the node's own ranks
(`NodeWeightSync`, updates.py), so a node that holds a whole actor replica receives no weight byte from
another node, and rank 0 sends about one model per step (to its own node's servers) whatever the number
of nodes.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import secrets
import socket
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.config import DEFAULT_BUCKET_MB, SGLangConfig
from megatron_dapo.rollout.base import RolloutEngine
from megatron_dapo.rollout.engine_group import EngineGroup
from megatron_dapo.rollout.restarts import Restarts
from megatron_dapo.rollout.sglang.engine import SGLangEngine
from megatron_dapo.rollout.sglang.environment import check_node_addresses, node_address
from megatron_dapo.rollout.sglang.server import SGLangServerError
from megatron_dapo.rollout.sglang.updates import NodeLayout, NodeWeightSync, payload_plan

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------- launching


def servers_per_node(cfg: SGLangConfig) -> int:
    """cfg.num_servers, or when 0 as many TP groups as this node's visible GPUs hold (one on CPU)."""
    if cfg.num_servers:
        return cfg.num_servers
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return max(gpus // cfg.tensor_parallel, 1)


def launch_servers(model_path: str | Path, cfg: SGLangConfig, restarts: Restarts | None = None,
                   **engine_kwargs: Any) -> RolloutEngine:
    """cfg.num_servers servers (server k: port base_port + k, devices from k*TP), started together.

    The processes are spawned from the calling thread (their parent-death signal follows it) and
    waited for in parallel. If any fails to start, all are stopped and the first failure (in server
    order) is raised. `engine_kwargs` go to every `SGLangEngine` (bucket_mb, dtype, device, log_dir...);
    `restarts`: the run's budget for restarting lost servers (engine_group.py).
    """
    count = servers_per_node(cfg)
    if count == 1:
        return recoverable([SGLangEngine(model_path, cfg, **engine_kwargs)], restarts)
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
    return EngineGroup(engines, restarts=restarts)


def restartable(restarts: Restarts | None) -> bool:
    """Whether rank 0's engine group restarts its lost servers (then a weight sync leaves a lost one out)."""
    return restarts is not None and restarts.max_restarts > 0


def recoverable(engines: list[SGLangEngine], restarts: Restarts | None) -> RolloutEngine:
    """The servers as one engine: a group, which restarts a lost server, where there are several or a restart
    budget (a lone server too); a lone server as itself otherwise."""
    if len(engines) == 1 and not restartable(restarts):
        return engines[0]
    return EngineGroup(engines, restarts=restarts)


@dataclass
class JobServers:
    """What `start_job_servers` leaves with a rank: the driver's engine (global rank 0 only), the servers
    this rank started (a node leader's), which it must shut down at the end, and its part in updating its
    node's servers (`weights`: every rank)."""

    engine: RolloutEngine | None
    owned: list[SGLangEngine]
    weights: NodeWeightSync | None = None

    def shutdown(self) -> None:
        if self.weights is not None:
            self.weights.shutdown()
        if self.engine is not None:
            self.engine.shutdown()
        for server in self.owned:
            server.shutdown()


def bucket_bytes(cfg: SGLangConfig, bucket_mb: int) -> int:
    return int((bucket_mb or DEFAULT_BUCKET_MB[cfg.weight_sync]) * 2**20)


def start_job_servers(model_path: str | Path, cfg: SGLangConfig, restarts: Restarts | None = None,
                      **engine_kwargs: Any) -> JobServers:
    """Called by every rank of the job (a collective). The lowest rank of each node starts cfg.num_servers
    servers there (bound to 127.0.0.1 in a one-node job, else to `node_address()`; node n's server k on
    port base_port + n * num_servers + k); every node's servers take their weights from that node's own
    ranks (`NodeWeightSync`, cfg.weight_sync: no weight byte crosses nodes). Global rank 0 gets one engine
    over all servers of the job for generation (the other nodes' attached). A server that fails to start
    fails every rank, naming it. The servers take one API key per job (rank 0's, `--api-key`), sent with
    every request: nothing else on the network can drive them."""
    import torch.distributed as dist

    from megatron_dapo import parallel

    env = parallel.launch_env()
    engine_kwargs.setdefault("api_key", secrets.token_urlsafe(32))  # this job's; every request carries it
    sync_bytes = bucket_bytes(cfg, engine_kwargs.get("bucket_mb", 0))
    colocated = bool(engine_kwargs.get("colocate", True))
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        engine = launch_servers(model_path, cfg, restarts, **engine_kwargs)
        servers = list(engine.engines) if isinstance(engine, EngineGroup) else [engine]
        layout = NodeLayout(node=0, ranks=(0,), servers=len(servers), tp=cfg.tensor_parallel,
                            colocated=colocated)
        sync = NodeWeightSync(servers, layout, 0, transport=cfg.weight_sync, bucket_bytes=sync_bytes)
        sync.restartable = restartable(restarts)
        return JobServers(engine, [], sync)
    rank, world = dist.get_rank(), dist.get_world_size()
    nodes: list[Any] = [None] * world
    dist.all_gather_object(nodes, (env.node_rank, env.local_rank, node_address(env.master_addr),
                                   socket.gethostname(), engine_kwargs["api_key"]))
    engine_kwargs["api_key"] = nodes[0][4]  # rank 0's key for every server of the job
    multi_node = len({n[0] for n in nodes}) > 1
    if multi_node:
        check_node_addresses([(n, addr, hostname) for n, _, addr, hostname, _ in nodes])
    mates = sorted((r for r in range(world) if nodes[r][0] == env.node_rank), key=lambda r: nodes[r][1])
    leader = rank == mates[0]
    host = nodes[rank][2] if multi_node else "127.0.0.1"
    count = servers_per_node(cfg)
    owned: list[SGLangEngine] = []
    report: Any = None
    if leader:
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
    sync = _node_weight_sync(owned, nodes, rank, cfg, count, colocated, sync_bytes, host)
    sync.restartable = restartable(restarts) and (rank == 0 or restarts.remote)  # restarted from rank 0
    if rank != 0:
        return JobServers(None, owned, sync)
    remote: list[SGLangEngine] = []
    for r, urls in enumerate(reports):
        if urls is None or r == 0:
            continue
        for url in urls:
            remote_host, port = url.removeprefix("http://").rsplit(":", 1)
            remote.append(SGLangEngine(model_path, cfg, host=remote_host, port=int(port), attach=True,
                                       trainer_host=host, **engine_kwargs))
            if restartable(restarts) and restarts.remote:  # by the rank that started it, waiting for the driver
                remote[-1].restarter = functools.partial(parallel.ask_ranks, f"restart_server {url}")
    log.info("SGLang servers: %s; each node's servers take their weights from the node's own ranks (%s)",
             ", ".join([e.url for e in owned] + [f"{e.url} (attached)" for e in remote]), cfg.weight_sync)
    engine = recoverable([*owned, *remote], restarts)
    return JobServers(engine, [], sync)


def _node_weight_sync(owned: list[SGLangEngine], nodes: list[Any], rank: int, cfg: SGLangConfig, count: int,
                      colocated: bool, sync_bytes: int, host: str) -> NodeWeightSync:
    """Every rank's part in its node's weight updates; the gloo groups of the nodes (made by every rank, in
    node order) where the plan has ranks other than the leader serialise payloads."""
    import torch.distributed as dist

    by_node: dict[int, list[int]] = {}
    for r in sorted(range(len(nodes)), key=lambda r: (nodes[r][0], nodes[r][1])):
        by_node.setdefault(nodes[r][0], []).append(r)
    layouts = {n: NodeLayout(node=n, ranks=tuple(rs), servers=count, tp=cfg.tensor_parallel,
                             colocated=colocated) for n, rs in by_node.items()}
    group = None
    others = any(s.rank != lay.leader for lay in layouts.values() for s in payload_plan(lay))
    if cfg.weight_sync == "tensor" and others:
        for n in sorted(layouts):
            g = dist.new_group(list(layouts[n].ranks), backend="gloo")
            if rank in layouts[n].ranks:
                group = g
    return NodeWeightSync(owned, layouts[nodes[rank][0]], rank, transport=cfg.weight_sync,
                          bucket_bytes=sync_bytes, trainer_host=host, group=group)
