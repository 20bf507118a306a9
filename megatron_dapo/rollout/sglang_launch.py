"""Start the configured SGLang servers: one `SGLangEngine`, or several behind an `EngineGroup`; in a
multi-node job, servers on every node (`start_job_servers`)."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_dapo.config import SGLangConfig
from megatron_dapo.rollout.base import RolloutEngine
from megatron_dapo.rollout.engine_group import EngineGroup
from megatron_dapo.rollout.sglang_broadcast import as_rollout_engine
from megatron_dapo.rollout.sglang_engine import SGLangEngine, SGLangServerError

log = logging.getLogger(__name__)


def servers_per_node(cfg: SGLangConfig) -> int:
    """cfg.num_servers, or when 0 as many TP groups as this node's visible GPUs hold (one on CPU)."""
    if cfg.num_servers:
        return cfg.num_servers
    import torch

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
    ("distributed", one shared group for all of them: sglang_broadcast.py; "disk" stays disk). A server
    that fails to start fails every rank, naming it."""
    import torch.distributed as dist

    from megatron_dapo import parallel

    env = parallel.launch_env()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return JobServers(launch_servers(model_path, cfg, **engine_kwargs), [])
    rank, world = dist.get_rank(), dist.get_world_size()
    nodes: list[Any] = [None] * world
    dist.all_gather_object(nodes, (env.node_rank, node_address()))
    multi_node = len({n for n, _ in nodes}) > 1
    leader = rank == min(r for r, (n, _) in enumerate(nodes) if n == env.node_rank)
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
