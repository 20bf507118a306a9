"""The one module that touches megatron.core.parallel_state: process groups, ranks, seeding.

Works under torchrun (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT), under srun (SLURM_PROCID,
SLURM_NTASKS, first host of SLURM_JOB_NODELIST) and as a single plain process. nccl with CUDA,
gloo without; on CPU megatron-core is made to run by `megatron_cpu.enable()`.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_dapo import heartbeat, megatron_cpu, network
from megatron_dapo.config import ParallelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    node_rank: int = 0
    """Which node this process runs on (torchrun's GROUP_RANK, Slurm's SLURM_NODEID)."""


def launch_env(environ: dict[str, str] | None = None) -> LaunchEnv:
    """Rank layout from torchrun's or Slurm's variables; a lone process is rank 0 of 1."""
    env = dict(os.environ if environ is None else environ)
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                         env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)),
                         int(env.get("GROUP_RANK", env.get("SLURM_NODEID", 0))))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        addr = env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_JOB_NODELIST", ""))
        port = int(env.get("MASTER_PORT") or 29500 + int(env.get("SLURM_JOB_ID", "0")) % 10000)
        return LaunchEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                         int(env.get("SLURM_LOCALID", 0)), addr, port, int(env.get("SLURM_NODEID", 0)))
    return LaunchEnv(0, 1, 0, "127.0.0.1", free_port())


def _first_slurm_host(nodelist: str) -> str:
    if not nodelist:
        return "127.0.0.1"
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=30, check=True).stdout.split()
        return out[0] if out else "127.0.0.1"
    except (OSError, subprocess.SubprocessError):
        return nodelist.split(",")[0].split("[")[0]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


MIXED_BACKEND = "cpu:gloo,cuda:nccl"
"""NCCL has no CPU backend: the trainer's small host-side messages (headers, counts, flags) would fail
with it alone, so every group carries gloo beside NCCL and torch picks by the tensors' device."""


def backend_for(cfg: ParallelConfig, *, cuda: bool | None = None) -> str:
    """The default group's backend: nccl means NCCL for device tensors and gloo for host tensors."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    backend = cfg.backend if cfg.backend != "auto" else "nccl" if cuda else "gloo"
    return MIXED_BACKEND if backend == "nccl" else backend


def initialize(cfg: ParallelConfig, *, seed: int, timeout_s: float | None = None) -> LaunchEnv:
    """Start torch.distributed (if needed) and Megatron's TP/PP/DP (and expert-parallel) groups; seed every
    RNG. `timeout_s`: one collective's limit (default cfg.timeout_s)."""
    timeout_s = cfg.timeout_s if timeout_s is None else timeout_s
    env = launch_env()
    megatron_cpu.enable()
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(env.master_port))
        store = None
        if single_node(env):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's own sockets stay local as well
            store = loopback_store(env, timedelta(seconds=timeout_s))
        elif several_hosts(env):  # every host-side collective is gloo's: not on the host name's address (127.0.1.1)
            _set_gloo_interface(env)
        dist.init_process_group(backend_for(cfg), rank=env.rank, world_size=env.world_size, store=store,
                                timeout=timedelta(seconds=timeout_s))
    tp, pp, ep = cfg.tensor_parallel, cfg.pipeline_parallel, cfg.expert_parallel
    if env.world_size % (tp * pp):
        raise ValueError(f"TP({tp}) x PP({pp}) does not divide world size {env.world_size}")
    if (env.world_size // (tp * pp)) % ep:
        raise ValueError(f"EP({ep}) does not divide the data-parallel size {env.world_size // (tp * pp)}")
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        # expert TP = TP (Megatron's default): each expert is split like a dense MLP, EP spreads experts over DP
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep)
    seed_all(seed)
    start_heartbeat(cfg.driver_heartbeat_timeout_s)
    return env


def several_hosts(env: LaunchEnv, environ: dict[str, str] | None = None) -> bool:
    """Whether the job may span hosts: Slurm's node count, else torchrun's local world against the world, else
    whether the master is off this machine."""
    e = os.environ if environ is None else environ
    nodes = e.get("SLURM_JOB_NUM_NODES") or e.get("SLURM_NNODES")
    if nodes:
        return nodes != "1"
    if e.get("LOCAL_WORLD_SIZE", "").isdigit():
        return int(e["LOCAL_WORLD_SIZE"]) < env.world_size
    return not network.is_loopback(env.master_addr)


def _set_gloo_interface(env: LaunchEnv) -> None:
    """GLOO_SOCKET_IFNAME = the interface of the address the node's SGLang servers bind (network.py)."""
    ifname = network.gloo_interface(env.master_addr)
    if ifname is None:
        log.warning("no usable network interface for this node's address %s: gloo resolves the host name %s "
                    "itself (set GLOO_SOCKET_IFNAME if that is loopback)", network.node_address(env.master_addr),
                    socket.gethostname())
        return
    os.environ["GLOO_SOCKET_IFNAME"] = ifname


def single_node(env: LaunchEnv, environ: dict[str, str] | None = None) -> bool:
    """Every rank on this machine (one process; srun on one node; MASTER_ADDR on loopback), and no
    torchrun agent that owns the store already."""
    e = os.environ if environ is None else environ
    if e.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return False
    nodes = e.get("SLURM_JOB_NUM_NODES") or e.get("SLURM_NNODES")
    return env.world_size == 1 or nodes == "1" or env.master_addr in ("127.0.0.1", "localhost", "::1")


def loopback_store(env: LaunchEnv, timeout: timedelta) -> dist.TCPStore:
    """The rendezvous store of a single-node job, listening on 127.0.0.1 only (torch's own binds every
    interface, whatever MASTER_ADDR says)."""
    if env.rank != 0:
        return dist.TCPStore("127.0.0.1", env.master_port, env.world_size, False, timeout=timeout)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", env.master_port))
    sock.listen()
    return dist.TCPStore("127.0.0.1", env.master_port, env.world_size, True, timeout=timeout,
                         master_listen_fd=sock.detach())


def seed_all(seed: int) -> None:
    """Seed python/torch RNGs and Megatron's tracker (TP ranks get distinct model-parallel seeds)."""
    import random

    from megatron.core import tensor_parallel

    random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, inference_rng_tracker=megatron_cpu.is_enabled(), force_reset_rng=True)


_driver_waits = 0
_heartbeat_timeout_s = ParallelConfig().driver_heartbeat_timeout_s


def start_heartbeat(timeout_s: float) -> None:
    """After torch.distributed starts: the driver beats (heartbeat.py); every rank learns how long a silence
    it tolerates in join_driver."""
    global _heartbeat_timeout_s
    _heartbeat_timeout_s = timeout_s
    if dist.get_world_size() > 1 and is_main():
        from torch.distributed.distributed_c10d import _get_default_store

        heartbeat.start(_get_default_store(), timeout_s)


def driver_phase(name: str) -> None:
    """The driver's current phase ("rollout of step 3"): a rank waiting in join_driver names it if the driver
    stops beating."""
    heartbeat.set_phase(name)


def join_driver(label: str, *, poll_s: float = 0.5) -> None:
    """Every rank: where the other ranks wait for work only the driver (global rank 0) does -- a rollout,
    an evaluation -- however long it takes. They poll the rendezvous store instead of waiting in a
    collective (which fails after parallel.timeout_s); a driver that dies breaks the store and the wait, one
    whose heartbeat stops for parallel.driver_heartbeat_timeout_s raises heartbeat.DriverHungError. Meanwhile
    they serve the driver's requests (ask_ranks) in the order it makes them."""
    global _driver_waits
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    from torch.distributed.distributed_c10d import _get_default_store

    _driver_waits += 1
    key, store = f"megatron_dapo/driver/{_driver_waits}/{label}", _get_default_store()
    if is_main():
        store.set(key, "1")
        return
    heartbeat.await_driver(store, key, _heartbeat_timeout_s, poll_s)


def on_driver_request(handler: Callable[[str], None] | None) -> None:
    """Every rank, once: what a request of the driver's (ask_ranks) runs, on every rank; None: no requests."""
    heartbeat.on_request(handler)


def ask_ranks(request: str) -> None:
    """The driver, while the other ranks wait for it (join_driver, from_driver; from any thread, one request at a
    time): every rank runs the registered handler on `request`, so it may hold collectives (the driver's here)."""
    from torch.distributed.distributed_c10d import _get_default_store

    heartbeat.ask(_get_default_store() if dist.is_initialized() and dist.get_world_size() > 1 else None, request)


def from_driver(label: str, value: str) -> str:
    """Every rank: the driver's `value` (host-side, through the rendezvous store), for what only the driver
    knows and every rank must agree on (whether a validation set was loaded: validation is collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    from torch.distributed.distributed_c10d import _get_default_store

    key, store = f"megatron_dapo/from_driver/{label}", _get_default_store()
    if is_main():
        store.set(key, value)
        return value
    heartbeat.await_driver(store, key, _heartbeat_timeout_s)
    return store.get(key).decode()


def barrier() -> None:
    """Every rank waits for the others (host-side ordering of memory phases across ranks)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(torch.zeros(1))  # a host tensor: gloo, also beside NCCL


def destroy() -> None:
    from megatron.core import parallel_state as ps

    heartbeat.stop()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    global _driver_waits
    _driver_waits = 0


# --- read access for the rest of the code base ------------------------------------------------


def _ps():
    from megatron.core import parallel_state

    return parallel_state


def tp_rank() -> int:
    return _ps().get_tensor_model_parallel_rank()


def tp_size() -> int:
    return _ps().get_tensor_model_parallel_world_size()


def tp_group():
    return _ps().get_tensor_model_parallel_group()


def pp_rank() -> int:
    return _ps().get_pipeline_model_parallel_rank()


def pp_size() -> int:
    return _ps().get_pipeline_model_parallel_world_size()


def pp_group():
    return _ps().get_pipeline_model_parallel_group()


def ep_rank() -> int:
    """This rank's place among the expert-parallel ranks (which experts it holds)."""
    return _ps().get_expert_model_parallel_rank()


def ep_size() -> int:
    return _ps().get_expert_model_parallel_world_size()


def ep_group():
    return _ps().get_expert_model_parallel_group()


def expert_tp_rank() -> int:
    return _ps().get_expert_tensor_parallel_rank()


def expert_tp_size() -> int:
    return _ps().get_expert_tensor_parallel_world_size()


def expert_tp_group():
    """The ranks that hold pieces of the same expert (Megatron's expert tensor parallel)."""
    return _ps().get_expert_tensor_parallel_group()


def dp_rank() -> int:
    return _ps().get_data_parallel_rank()


def dp_size() -> int:
    return _ps().get_data_parallel_world_size()


def dp_group():
    return _ps().get_data_parallel_group()


def mp_group():
    """The tensor x pipeline ranks of this data-parallel replica (they train on the same rows)."""
    return _ps().get_model_parallel_group()


def dp_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over the data-parallel ranks in place (a collective when DP > 1); returns it."""
    if dist.is_initialized() and dp_size() > 1:
        dist.all_reduce(t, group=dp_group())
    return t


def dp_max(t: torch.Tensor) -> torch.Tensor:
    """Element-wise max of `t` over the data-parallel ranks, in place; returns it."""
    if dist.is_initialized() and dp_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dp_group())
    return t


def is_first_stage() -> bool:
    return _ps().is_pipeline_first_stage()


def is_last_stage() -> bool:
    return _ps().is_pipeline_last_stage()


def last_stage_global_rank() -> int:
    return _ps().get_pipeline_model_parallel_last_rank()


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return global_rank() == 0


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
