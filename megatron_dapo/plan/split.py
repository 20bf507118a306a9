"""The disaggregated layout (`rollout.colocate=false`, SGLang): which GPUs train and which generate.

Every split of the cluster is planned -- whole nodes when there are two or more (the first t nodes train,
the other nodes generate), else the GPUs of the one node (the first k train) -- with `make_plan` on the
training side and the engine sized on the generation side (the same memory model and the same refusals
as a colocated plan). Of the splits that fit, the one with the least estimated step time (plan/cost.py)
is chosen: the pipelined step max(generation, training) + sync with rollout.async_steps >= 1, else the
synchronous generation + training + sync. No split fits: refused, every split's reasons listed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from megatron_dapo.config import Config
from megatron_dapo.plan.build import make_plan
from megatron_dapo.plan.core import Hardware, Links, Plan, record
from megatron_dapo.plan.cost import Estimate, Throughput, Workload, estimate

if TYPE_CHECKING:
    from megatron_dapo.actor.model import ModelSpec


def is_disaggregated(cfg: Config) -> bool:
    """The configs the split planner handles: SGLang servers on their own GPUs."""
    return not cfg.rollout.colocate and cfg.rollout.engine == "sglang"


@dataclass(frozen=True, kw_only=True)
class Side:
    """One side of a split: its GPUs as global ranks (node = rank // gpus_per_node) and its Hardware."""

    hardware: Hardware
    first_rank: int
    gpus_per_node: int
    """Of the cluster."""

    @property
    def gpus(self) -> int:
        return self.hardware.world_size

    @property
    def last_rank(self) -> int:
        return self.first_rank + self.gpus - 1

    @property
    def nodes(self) -> tuple[int, int]:
        return self.first_rank // self.gpus_per_node, self.last_rank // self.gpus_per_node

    def describe(self) -> str:
        first, last = self.nodes
        g = self.gpus_per_node
        if first == last and self.gpus < g:
            return f"node {first} GPUs {self.first_rank % g}-{self.last_rank % g}"
        nodes = f"node {first}" if first == last else f"nodes {first}-{last}"
        return f"{nodes} (ranks {self.first_rank}-{self.last_rank})"

    def to_dict(self) -> dict[str, Any]:
        return {"gpus": self.gpus, "nodes": list(self.nodes), "ranks": [self.first_rank, self.last_rank],
                "text": self.describe()}


@dataclass(frozen=True, kw_only=True)
class Split:
    train: Side
    generate: Side

    @property
    def same_node(self) -> bool:
        """The sides share a node: the weights go over NVLink, not InfiniBand."""
        return self.train.nodes[1] == self.generate.nodes[0]

    @property
    def text(self) -> str:
        return f"train {self.train.describe()} / generate {self.generate.describe()}"


def candidate_splits(hw: Hardware) -> list[Split]:
    """Whole nodes when there are two or more, else the GPUs of the one node; training first."""
    g = hw.gpus_per_node
    if hw.nodes >= 2:
        shapes = [((t, g), (hw.nodes - t, g), t * g) for t in range(1, hw.nodes)]
    else:
        shapes = [((1, k), (1, g - k), k) for k in range(1, g)]
    return [Split(train=Side(hardware=replace(hw, nodes=tn, gpus_per_node=tg), first_rank=0, gpus_per_node=g),
                  generate=Side(hardware=replace(hw, nodes=gn, gpus_per_node=gg), first_rank=first,
                                gpus_per_node=g))
            for (tn, tg), (gn, gg), first in shapes]


@dataclass(frozen=True, kw_only=True)
class SplitOption:
    split: Split
    plan: Plan
    """The training side's plan, its engine sized on the generation side."""
    estimate: Estimate | None = None
    """None when the split does not fit."""

    @property
    def fits(self) -> bool:
        return self.plan.fits

    def to_dict(self) -> dict[str, Any]:
        return {"train": self.split.train.to_dict(), "generate": self.split.generate.to_dict(),
                "fits": self.fits, "problems": list(self.plan.problems),
                "seconds": None if self.estimate is None else record(
                    self.estimate.step, "synchronous", "pipelined", "ratio", "limit")}


@dataclass(frozen=True, kw_only=True)
class Disaggregated:
    """Every split of the cluster, planned; `chosen`: the one that fits with the least step time."""

    config: str
    cluster: Hardware
    async_steps: int
    options: tuple[SplitOption, ...]
    assumptions: tuple[str, ...]
    workload: Workload
    throughput: Throughput
    links: Links

    @property
    def objective(self) -> str:
        return "pipelined" if self.async_steps >= 1 else "synchronous"

    def step_seconds(self, option: SplitOption) -> float:
        assert option.estimate is not None
        return getattr(option.estimate.step, self.objective)

    @property
    def chosen(self) -> SplitOption | None:
        fitting = [o for o in self.options if o.estimate is not None]
        return min(fitting, key=self.step_seconds, default=None)

    @property
    def fits(self) -> bool:
        return self.chosen is not None

    @property
    def problems(self) -> tuple[str, ...]:
        """Empty when a split fits; else every split's reasons, each naming its split."""
        if self.fits:
            return ()
        if not self.options:
            return (f"rollout.colocate=false needs at least 2 GPUs (one side trains, the other generates); "
                    f"the cluster has {self.cluster.world_size}",)
        return tuple(f"{o.split.text}: {p}" for o in self.options for p in o.plan.problems)

    def to_dict(self) -> dict[str, Any]:
        chosen = self.chosen
        split = {"cluster": record(self.cluster, "world_size"), "async_steps": self.async_steps,
                 "objective": self.objective, "assumptions": list(self.assumptions),
                 "workload": record(self.workload), "throughput": record(self.throughput),
                 "links": record(self.links), "splits": [o.to_dict() for o in self.options],
                 "chosen": None}
        if chosen is None or chosen.estimate is None:
            return {"config": self.config, "hardware": record(self.cluster, "world_size"),
                    "disaggregated": split, "problems": list(self.problems), "warnings": [], "fits": False}
        split |= {"chosen": self.options.index(chosen), "train": chosen.split.train.to_dict(),
                  "generate": chosen.split.generate.to_dict()} | chosen.estimate.to_dict()
        return chosen.plan.to_dict() | {"disaggregated": split}


def assumptions(cfg: Config, work: Workload, thr: Throughput, links: Links) -> tuple[str, ...]:
    r, a = cfg.rollout, cfg.algo
    upper = work.prompt_tokens == r.max_prompt_len and work.response_tokens == r.max_response_len
    pi_old = "no pi_old forward (old_logprob_source=rollout)" if a.old_logprob_source == "rollout" else \
        "+ 2N the pi_old forward"
    rounds = a.max_gen_rounds if a.dynamic_sampling else 1
    return (
        f"lengths: {work.prompt_tokens} prompt + {work.response_tokens} response tokens per sequence "
        f"(--prompt-len, --response-len){': the maxima, so every time is an upper bound' if upper else ''}",
        f"compute: {thr.peak_tflops:g} TFLOP/s bf16 peak per GPU x MFU {thr.mfu:g} for training and prefill "
        f"(--peak-tflops, --mfu); decode reads HBM at {links.hbm:g} GB/s x {thr.hbm_util:g} (--hbm-gbs, "
        f"--hbm-util)",
        f"training FLOPs per token: 6N per epoch (+ 2N with recompute=full) {pi_old}, N the activated "
        f"params; attention's T^2 term and the pipeline bubble not counted",
        f"generation: {work.gen_rounds:g} round(s) of gen_batch_multiplier x prompt_batch_size prompts x G "
        f"per step (--gen-rounds; dynamic sampling allows up to {rounds}); a decode step on the roofline of "
        f"weights + in-flight KV bytes and 2N FLOPs per sequence; prefill once per prompt (radix cache)",
        f"weight sync: the training side's refit + the model once over the link between the sides "
        f"(InfiniBand {links.ib:g} GB/s across nodes, NVLink {links.nvlink:g} GB/s inside one; --ib-gbs, "
        f"--nvlink-gbs)",
    )


def plan_disaggregated(cfg: Config, spec: ModelSpec, hw: Hardware, *, work: Workload,
                       throughput: Throughput = Throughput(), links: Links = Links(), model_source: str = "",
                       config_name: str = "", rollout_concurrency: int | None = None) -> Disaggregated:
    options = []
    for split in candidate_splits(hw):
        plan = make_plan(cfg, spec, split.train.hardware, model_source=model_source, config_name=config_name,
                         rollout_concurrency=rollout_concurrency, links=links,
                         rollout_hw=split.generate.hardware)
        est = estimate(cfg, plan, work, throughput, links, same_node=split.same_node) if plan.fits else None
        options.append(SplitOption(split=split, plan=plan, estimate=est))
    return Disaggregated(config=config_name, cluster=hw, async_steps=cfg.rollout.async_steps,
                         options=tuple(options), assumptions=assumptions(cfg, work, throughput, links),
                         workload=work, throughput=throughput, links=links)
