"""The rollout engine a run generates with: SGLang servers (node leaders start them, the driver drives them
all) or the embedded engine (the driver only), on the actor's own weights where they can be shared
(shared_weights.py) and stay in place while it generates. On its own devices (rollout.colocate=false) the
embedded engine runs in a process of its own (rollout/embedded/process_engine.py) on its own share of the cores, in
the synchronous loop as with off-policy pipelining: it never lends them to the actor, as a GPU it owned
would not be."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_dapo import parallel
from megatron_dapo.actor.actor import Actor
from megatron_dapo.actor.model import param_dtype
from megatron_dapo.config import Config, ModelConfig
from megatron_dapo.loop.report import StartupReport
from megatron_dapo.rollout.base import RolloutEngine
from megatron_dapo.rollout.restarts import Restarts
from megatron_dapo.schedule.pipeline import engine_threads


@dataclass
class EngineSetup:
    engine: RolloutEngine | None
    """The engine over every server of the job: global rank 0 (the driver) only."""
    on_actor_weights: bool = False
    """The embedded engine generates on the actor's parameters (decides pi_old's auto source)."""
    servers: list[Any] = field(default_factory=list)
    """SGLang: the servers this rank started (a node leader's), to stop at the end."""
    weights: Any = None
    """SGLang: the weight-update channels of the phases' sync."""
    threads: int | None = None
    """The embedded engine's own torch threads when it runs in a process of its own (the actor has the rest)."""


def make_engine(cfg: Config, actor: Actor, report: StartupReport, restarts: Restarts | None = None) -> EngineSetup:
    """Every rank (node leaders start SGLang servers); the start-up report says which engine and why. `restarts`:
    the run's budget for restarting a lost server or engine process (the driver's engine uses it)."""
    if cfg.rollout.engine == "sglang":
        threads = _own_cpu_threads() if not cfg.rollout.colocate and not torch.cuda.is_available() else None
        servers = _start_sglang(cfg, cfg.model.hf_dir, threads, restarts)
        report.engine = f"sglang ({len(servers.owned)} server(s) started by this rank" + (
            f"; {threads} thread(s) each, the actor keeps {torch.get_num_threads()}: the engine is on its own "
            "devices (rollout.colocate=false))" if threads else ")")
        return EngineSetup(servers.engine, servers=servers.owned, weights=servers.weights, threads=threads)
    if not parallel.is_main():  # the weights are shared in a one-process job only: every rank resolves pi_old alike
        return EngineSetup(None)
    if not cfg.rollout.colocate:
        engine, threads = _own_process_engine(cfg.model, report, _why_own_weights(cfg), restarts)
        return EngineSetup(engine, threads=threads)
    engine, shared = _embedded_engine(actor, cfg.model, report, _why_own_weights(cfg))
    return EngineSetup(engine, on_actor_weights=shared)


def _own_cpu_threads() -> int:
    """SGLang servers on their own CPU cores (rollout.colocate=false; their idle scheduler alone keeps a core
    busy): their share of this process's torch threads, which this process gives up."""
    total = torch.get_num_threads()
    threads = engine_threads(total)
    torch.set_num_threads(max(1, total - threads))
    return threads


def _start_sglang(cfg: Config, hf_dir: str, threads: int | None, restarts: Restarts | None):
    """Every rank: node leaders start SGLang servers (on CPU with `threads` OMP threads each, None = the
    environment's); global rank 0 gets the engine over all of them."""
    from megatron_dapo.rollout.sglang.fleet import start_job_servers

    # the actor's dtype, not SGLang's "auto" (which serves a float32 checkpoint in float16)
    dtype = str(param_dtype(cfg.model)).removeprefix("torch.")
    return start_job_servers(hf_dir, cfg.rollout.sglang, restarts, bucket_mb=cfg.rollout.weight_sync_bucket_mb,
                             dtype=dtype, colocate=cfg.rollout.colocate, threads=threads,
                             deterministic=cfg.train.deterministic,
                             return_routes=cfg.actor.routing_replay == "r3")


def _why_own_weights(cfg: Config) -> str | None:
    """Why the embedded engine must not generate on the actor's parameters even where it could."""
    if cfg.rollout.async_steps:
        return "the engine generates while the actor trains (rollout.async_steps)"
    if not cfg.rollout.colocate:
        return "the engine is on its own devices (rollout.colocate=false)"
    if cfg.actor.offload_when_idle:
        return "the actor offloads while it generates: actor.offload_when_idle=false shares the actor's weights"
    return None


def _own_process_engine(model_cfg: ModelConfig, report: StartupReport, why_own: str,
                        restarts: Restarts | None) -> tuple[RolloutEngine, int]:
    """The embedded engine from hf_dir in a process of its own (not a thread: it would share the interpreter
    lock with the actor) with its share of the torch threads, which this process gives up; and that share."""
    from megatron_dapo.rollout.embedded.process_engine import ProcessEngine

    total = torch.get_num_threads()
    threads = engine_threads(total)
    actor_threads = max(1, total - threads)
    torch.set_num_threads(actor_threads)
    dtype = param_dtype(model_cfg)
    engine = ProcessEngine(model_cfg.hf_dir, threads=threads, device=parallel.device(), dtype=dtype, restarts=restarts)
    report.engine = (f"embedded, in its own process ({threads} thread{'s' if threads > 1 else ''}, pid {engine.pid}; "
                     f"the actor keeps {actor_threads}) with its own {str(dtype).removeprefix('torch.')} "
                     f"copy of the weights (from {model_cfg.hf_dir}; {why_own})")
    return engine, threads


def _embedded_engine(actor: Actor, model_cfg: ModelConfig, report: StartupReport,
                     why_own: str | None) -> tuple[RolloutEngine, bool]:
    """On the actor's own weights when they can be shared (shared_weights.py) and stay in place while the
    engine generates (`why_own` is None), else from hf_dir; and whether it is on the actor's weights."""
    from megatron_dapo.loop.shared_weights import can_share, model_on_actor_weights
    from megatron_dapo.rollout.embedded import EmbeddedEngine

    hf_dir, dtype = model_cfg.hf_dir, param_dtype(model_cfg)
    own = f"its own {str(dtype).removeprefix('torch.')} copy of the weights (from {hf_dir}"
    if not can_share(actor, dtype):
        report.engine = f"embedded, {own})"
        return EmbeddedEngine(hf_dir, device=parallel.device(), dtype=dtype), False
    if why_own:
        report.engine = f"embedded, {own}; {why_own})"
        return EmbeddedEngine(hf_dir, device=parallel.device(), dtype=dtype), False
    model, shared = model_on_actor_weights(actor, hf_dir)
    total = sum(p.numel() for p in model.parameters())
    report.engine = f"embedded, on the actor's weights ({shared / 1e6:.2f}M of {total / 1e6:.2f}M parameters shared)"
    return EmbeddedEngine(model, device=parallel.device(), dtype=dtype, borrowed=actor.module.parameters()), True
