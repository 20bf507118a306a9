"""The planner's typed plan: hardware, model, layout, per-GPU memory of each phase, tokens per step.

A phase of the colocated hybrid engine (loop/colocation.py, the table the trainer follows too:
generate, train, sync) is a `PhaseMemory`: named components with their bytes per side (actor,
engine) plus the reserve. `megatron_dapo.plan.build.make_plan` fills these types;
`megatron_dapo.plan.memory` holds the memory model behind the numbers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

GIB = 2**30


def fmt_gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}"


def record(obj: Any, *derived: str) -> dict[str, Any]:
    """A dataclass's fields plus the named derived properties, for JSON."""
    return asdict(obj) | {name: getattr(obj, name) for name in derived}


@dataclass(frozen=True, kw_only=True)
class Hardware:
    nodes: int
    gpus_per_node: int
    gpu_mem_gib: float = 80.0
    reserve_gib: float = 4.0
    max_util: float = 0.9

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def budget_gib(self) -> float:
        return self.gpu_mem_gib * self.max_util

    @property
    def gpu_bytes(self) -> float:
        return self.gpu_mem_gib * GIB

    @property
    def budget_bytes(self) -> float:
        return self.budget_gib * GIB

    @property
    def reserve_bytes(self) -> float:
        return self.reserve_gib * GIB

    @property
    def limit_text(self) -> str:
        return f"{self.max_util:g} x {self.gpu_mem_gib:g} = {self.budget_gib:.1f} GiB"


@dataclass(frozen=True, kw_only=True)
class ModelSummary:
    source: str
    params: int
    activated_params: int
    """Parameters one token runs through (a MoE model's top-k experts; = params if dense)."""
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    vocab_padded: int
    tied_embeddings: bool
    experts: int = 0
    experts_per_token: int = 0


@dataclass(frozen=True, kw_only=True)
class Layout:
    world_size: int
    tp: int
    pp: int
    dp: int
    sequence_parallel: bool
    ep: int = 1
    """Expert parallel: the routed experts split over EP of the DP ranks."""
    recompute: str
    distributed_optimizer: bool
    dtype: str
    layers_per_stage: int | None  # None: PP does not divide the layers


@dataclass(frozen=True, kw_only=True)
class PhaseMemory:
    """What one GPU holds in one phase: component name -> bytes for each side, plus the reserve."""

    name: str
    actor: dict[str, float] = field(default_factory=dict)
    engine: dict[str, float] = field(default_factory=dict)
    reserve: float = 0.0

    @property
    def total(self) -> float:
        return sum(self.actor.values()) + sum(self.engine.values()) + self.reserve

    def to_dict(self) -> dict[str, Any]:
        return record(self, "total")


@dataclass(frozen=True, kw_only=True)
class StageMemory:
    """The train phase on one GPU of one pipeline stage."""

    stage: int
    params: int
    weights: float
    main_grads: float
    optimizer: float
    activations_train: float
    activations_logprob: float
    train_tokens: int
    logprob_tokens: int
    reserve: float

    @property
    def activations(self) -> float:
        return max(self.activations_train, self.activations_logprob)

    @property
    def state(self) -> float:
        """Weights, grads and optimizer: what actor.offload_when_idle moves to host memory."""
        return self.weights + self.main_grads + self.optimizer

    @property
    def components(self) -> dict[str, float]:
        """The actor's components by the phase model's names (loop/colocation.py)."""
        return {"weights": self.weights, "main_grads": self.main_grads, "optimizer": self.optimizer,
                "activations": self.activations}

    @property
    def total(self) -> float:
        """The train phase on this stage: every component plus the reserve."""
        return sum(self.components.values()) + self.reserve

    def to_dict(self) -> dict[str, Any]:
        return record(self, "activations", "total")


@dataclass(frozen=True, kw_only=True)
class TrainPhase:
    stages: tuple[StageMemory, ...]

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)


@dataclass(frozen=True, kw_only=True)
class SGLangPool:
    """SGLang's static pool (mem_fraction_static x GPU) per GPU: engine weights + KV cache."""

    sglang_tp: int
    engines: int
    engines_per_node: int
    weights: float
    static_pool: float
    kv_bytes_per_token_engine: int
    kv_bytes_per_token_gpu: int
    kv_pool_tokens_per_engine: int
    max_sequence_tokens: int
    worst_case_sequences_in_flight: int
    sequences_per_round_per_engine: int
    worst_case_waves_per_round: int | None
    requested_concurrency: int | None = None  # --rollout-concurrency
    requested_kv: int | None = None

    @property
    def kv_pool(self) -> float:
        return self.static_pool - self.weights

    @property
    def components(self) -> dict[str, float]:
        """The engine's components by the phase model's names (SGLang's memory tags)."""
        return {"weights": self.weights, "kv_cache": self.kv_pool}

    def to_dict(self) -> dict[str, Any]:
        return record(self, "kv_pool")


@dataclass(frozen=True, kw_only=True)
class IdleActor:
    """The actor's state on the GPU while a colocated engine generates."""

    resident: float
    offloaded: bool  # actor.offload_when_idle
    host_offload_per_node: float


@dataclass(frozen=True, kw_only=True)
class RolloutPhase:
    """Generation: the engine's sizing and, for colocated SGLang, what the actor leaves on the GPU."""

    engine: str
    colocate: bool
    sglang: SGLangPool | None = None  # rollout.engine=sglang
    actor: IdleActor | None = None  # colocated SGLang: the phase shares the actor's GPUs
    reserve: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"engine": self.engine, "colocate": self.colocate}
        if self.sglang is not None:
            out |= self.sglang.to_dict()
        if self.actor is not None:
            out |= {"actor_resident": self.actor.resident, "actor_offloaded": self.actor.offloaded,
                    "reserve": self.reserve, "host_offload_per_node": self.actor.host_offload_per_node}
        return out


@dataclass(frozen=True, kw_only=True)
class TokenBudget:
    """Tokens and updates per step; upper bounds (every sequence at its maximum length)."""

    sequence_tokens_max: int
    trained_sequences_per_step: int
    trained_tokens_per_step_max: int
    trained_tokens_per_dp_rank_max: int
    generation_prompts_per_round: int
    generated_sequences_per_round: int
    generated_tokens_per_round_max: int
    max_generation_rounds: int
    updates_per_step: int
    sequences_per_update: int
    micro_batches_per_update_per_dp_rank_max: int
    route_bytes_per_step_max: int = 0
    """actor.routing_replay=r3: the rollout's routes of the trained tokens (every layer's top-k, uint8 up to 256
    experts), scattered with their rows and held beside them on each DP rank (0 otherwise)."""
    route_bytes_per_dp_rank_max: int = 0
    route_bytes_held_max: int = 0
    """r3: what the driver's host holds at once (the step it trains and rollout.async_steps batches in the pipeline),
    and a checkpoint writes (trainer_tensors.safetensors), partial rollout's carried groups aside."""


@dataclass(frozen=True, kw_only=True)
class Links:
    """Bandwidths in GB/s (1e9 B/s): nominal H100/H200 figures unless given (--nvlink-gbs ...)."""

    nvlink: float = 450.0
    """NVLink 4 per GPU and direction."""
    ib: float = 50.0
    """One 400 Gb/s NDR NIC per GPU."""
    hbm: float = 3350.0
    """H100 SXM (H200: 4800)."""
    bucket_overhead_s: float = 0.010
    """Assumed per bucket (a node's servers load it at once): an HTTP round trip, SGLang's TP barrier."""


@dataclass(frozen=True, kw_only=True)
class Refit:
    model_bytes: float
    bucket_bytes: float
    """rollout.weight_sync_bucket_mb (resolved per transport)."""
    largest_bucket_bytes: float
    """The largest bucket: the configured size, or the largest tensor, which travels alone."""
    buckets: int
    tp_gather_bytes: float
    ep_receive_bytes: float
    """Routed experts broadcast from the expert-parallel rank that holds them."""
    ep_link: str
    pp_receive_bytes: float
    tp_link: str
    pp_link: str
    cross_node_bytes_per_node: float
    gather_s: float
    copy_s: float
    overhead_s: float
    sync_buffer_bytes: float
    """What the sync phase holds on a trainer GPU for the transfer."""

    @property
    def seconds(self) -> float:
        return self.gather_s + self.copy_s + self.overhead_s


PUBLISHED_REFIT = ("NeMo-RL (published): Qwen3-30B-A3B BF16, NCCL reshard refit 0.74-1.0 s "
                   "(docs/design-docs/nccl-reshard-refit.md)")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything the planner found; `problems` non-empty = refused."""

    config: str
    hardware: Hardware
    model: ModelSummary
    layout: Layout
    train: TrainPhase
    rollout: RolloutPhase
    tokens: TokenBudget
    phases: tuple[PhaseMemory, ...] = ()
    """Each phase of the phase model on one GPU of the worst stage (engine sized for colocated SGLang)."""
    refit: Refit | None = None
    """The weight sync into SGLang servers (plan/refit.py); None for the embedded engine."""
    problems: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        return not self.problems

    def phase(self, name: str) -> PhaseMemory:
        return next(p for p in self.phases if p.name == name)

    def to_dict(self) -> dict[str, Any]:
        hw = self.hardware
        memory = {"gpu": hw.gpu_bytes, "budget": hw.budget_bytes, "train_phase": self.train.worst.to_dict(),
                  "stages": [s.to_dict() for s in self.train.stages], "rollout_phase": self.rollout.to_dict()}
        return {"config": self.config, "hardware": record(hw, "world_size"), "model": asdict(self.model),
                "layout": asdict(self.layout), "memory": memory,
                "phases": {p.name: p.to_dict() for p in self.phases}, "tokens": asdict(self.tokens),
                "refit": None if self.refit is None else record(self.refit, "seconds"),
                "problems": list(self.problems), "warnings": list(self.warnings), "fits": self.fits}
