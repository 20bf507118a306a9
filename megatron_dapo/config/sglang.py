"""rollout.sglang: the SGLang servers of a job (their layout, ports, time limits, weight transport, restarts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_dapo.config.fields import knob


@dataclass(kw_only=True)
class SGLangConfig:
    mem_fraction_static: float = knob(0.6, "(0, 1)")
    """Fraction of GPU memory SGLang takes for weights + KV cache when colocated."""
    tensor_parallel: int = knob(1, "[1, inf)")
    """TP size of each SGLang server (one server per rollout TP group)."""
    num_servers: int = knob(0, "[0, inf)", "0 = fill the node")
    """SGLang servers per node, one per rollout TP group (0 = fill the node: visible GPUs // TP, one on
    CPU). Server k uses GPUs k*TP .. k*TP+TP-1; prompts are split evenly over all servers of the job,
    weight updates go to every one."""
    base_port: int = knob(30000, "[1, 65535]", on_resume=True)
    """First port; server k listens on base_port + k, bound to 127.0.0.1. Keep the ports outside 22000-29999:
    SGLang draws each server's torch.distributed port there, and one may take a port a server binds later."""
    startup_timeout_s: float = knob(600.0, "(0, inf)", on_resume=True)
    """Fail (naming the server log) if /health does not answer within this time."""
    request_timeout_s: float = knob(3600.0, "(0, inf)", on_resume=True)
    """Fail a /generate call that takes longer than this."""
    weight_sync: Literal["tensor", "distributed", "disk"] = "tensor"
    """tensor = colocated in-memory buckets; distributed = NCCL broadcast; disk = via files."""
    extra_args: str = ""
    """Extra `sglang.launch_server` flags, passed through verbatim."""
    max_restarts: int = knob(3, "[0, inf)", "0 = a lost engine stops the run", on_resume=True)
    """Rollout engines restarted per run. A server that dies, or misses its health check for health_timeout_s, is
    stopped for good (its process group) and started again on its devices and port; its groups are generated again
    from their prompts with their seeds, by the other servers meanwhile or, where none holds the current weights (a
    lone server), by itself. It takes the current weights from the actor as soon as the run can give them (the probe
    checks them): at once where nothing else generates or the servers have devices of their own
    (rollout.colocate=false), else before the next rollout; one lost during a weight sync, in that sync. Lagged
    runs (rollout.lagged) give it the last snapshot the servers took again (kept for this: one more host copy of
    the model). With rollout.async_steps=1 batches or weight_sync=distributed it waits for the next weight update
    instead and a lone server's loss stops the run (distributed: a loss during the sync too). Another node's
    server is restarted by that node's rank at rank 0's request (rank 0 sees its port refuse connections, or its
    health check silent); not with rollout.async_steps > 0 (that rank trains meanwhile): its loss stops the run.
    The embedded engine's own process (rollout.colocate=false) comes back with the last weights and its pending
    groups. Past this many, the run stops with one line naming the engine and its log, saving nothing new."""
    health_timeout_s: float = knob(120.0, "(0, inf)", on_resume=True)
    """A server whose health check (its load report, rollout/sglang/health.py) goes unanswered this long is hung."""
