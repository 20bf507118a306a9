"""The planner's time model for a disaggregated step (plan/split.py): seconds of generation, training and
weight sync from FLOPs and bytes. A dry-run estimate, not a measurement; the hardware figures are flags
(`Throughput`: --peak-tflops, --mfu, --hbm-util; `Links`: --hbm-gbs, --ib-gbs, --nvlink-gbs).

  lengths     a sequence has P prompt + R response tokens: --prompt-len, --response-len (default the
              config's max_prompt_len, max_response_len: every figure is then an upper bound)
  N           the parameters a token runs through (a MoE model's activated ones)
  training    FLOPs = (6 E [+ 2 E with model.recompute=full] + 2 for the pi_old forward, unless
              algo.old_logprob_source=rollout) x N x sequences x (P + R); E = algo.epochs_per_rollout;
              seconds = FLOPs / (training GPUs x peak x MFU). Attention's T^2 term and the pipeline
              bubble are not counted (the MFU stands for them)
  generation  per engine (sglang TP GPUs), one round: S = ceil(prompts x G / engines) sequences, C at once
              (what the KV pool holds at P + R tokens each; at most --rollout-concurrency), so
              ceil(S / C) waves of R decode steps. A decode step reads, per GPU, the engine's weights and
              the KV cache of C sequences at their mean length P + R/2, and computes 2 N C / TP FLOPs:
              it takes max(bytes / (HBM x hbm_util), FLOPs / (peak x MFU)). Prefill: 2 N P FLOPs per
              prompt (its G samples share it through the radix cache) over TP GPUs at peak x MFU.
              seconds = --gen-rounds x (decode + prefill)
  weight sync the refit of plan/refit.py on the training side (gather, bucket copies, per-bucket overhead)
              + the model's bytes once over the link between the sides: InfiniBand when they are on
              different nodes, NVLink inside one node (a broadcast pipelines its buckets: every receiver
              gets them at the sender's link speed)
  step        synchronous = generation + training + sync (each side idles while the other works);
              pipelined (rollout.async_steps=1) = max(generation, training) + sync; limit = max / sum
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megatron_dapo.config import Config
from megatron_dapo.plan.core import Links, Plan, Refit, record


@dataclass(frozen=True, kw_only=True)
class Throughput:
    """Per-GPU compute figures (H100 / H200 SXM unless given)."""

    peak_tflops: float = 989.0
    """Dense bf16 peak, TFLOP/s (H100 and H200 SXM alike)."""
    mfu: float = 0.4
    """Fraction of the peak that training and prefill reach (Megatron at scale: 0.35-0.45)."""
    hbm_util: float = 0.7
    """Fraction of the HBM bandwidth a decode step reaches."""

    @property
    def flops(self) -> float:
        """Achieved FLOP/s per GPU."""
        return self.peak_tflops * 1e12 * self.mfu


@dataclass(frozen=True, kw_only=True)
class Workload:
    prompt_tokens: int
    response_tokens: int
    gen_rounds: float = 1.0

    @classmethod
    def of(cls, cfg: Config, prompt_tokens: int | None = None, response_tokens: int | None = None,
           gen_rounds: float = 1.0) -> Workload:
        """The config's maxima unless given."""
        return cls(prompt_tokens=prompt_tokens or cfg.rollout.max_prompt_len,
                   response_tokens=response_tokens or cfg.rollout.max_response_len, gen_rounds=gen_rounds)

    @property
    def sequence_tokens(self) -> int:
        return self.prompt_tokens + self.response_tokens


@dataclass(frozen=True, kw_only=True)
class TrainTime:
    gpus: int
    tokens: int
    """Trained tokens per step: sequences x (P + R)."""
    flops_per_param_token: int
    params: int
    flops: float
    seconds: float


@dataclass(frozen=True, kw_only=True)
class GenTime:
    engines: int
    sglang_tp: int
    sequences_per_engine: int
    concurrent: int
    waves: int
    decode_steps: int
    bytes_per_step: float
    """Read per GPU by one decode step: the engine's weights + the KV cache in flight."""
    flops_per_step: float
    """Per GPU."""
    step_s: float
    bound: str
    """memory or compute: which side of the roofline a decode step sits on."""
    decode_s: float
    prefill_s: float
    rounds: float
    seconds: float


@dataclass(frozen=True, kw_only=True)
class SyncTime:
    refit_s: float
    model_bytes: float
    link: str
    transfer_s: float

    @property
    def seconds(self) -> float:
        return self.refit_s + self.transfer_s


@dataclass(frozen=True, kw_only=True)
class StepTimes:
    generation: float
    training: float
    sync: float

    @property
    def synchronous(self) -> float:
        return self.generation + self.training + self.sync

    @property
    def pipelined(self) -> float:
        return max(self.generation, self.training) + self.sync

    @property
    def ratio(self) -> float:
        return self.pipelined / self.synchronous

    @property
    def limit(self) -> float:
        """max / sum of the two sides: the ratio if the weight sync took no time."""
        return max(self.generation, self.training) / (self.generation + self.training)


@dataclass(frozen=True, kw_only=True)
class Estimate:
    train: TrainTime
    generation: GenTime
    sync: SyncTime

    @property
    def step(self) -> StepTimes:
        return StepTimes(generation=self.generation.seconds, training=self.train.seconds,
                         sync=self.sync.seconds)

    def to_dict(self) -> dict[str, Any]:
        """`seconds`: the step's; `estimate`: how each side's seconds came about."""
        return {"seconds": record(self.step, "synchronous", "pipelined", "ratio", "limit"),
                "estimate": {"training": record(self.train), "generation": record(self.generation),
                             "sync": record(self.sync, "seconds")}}


def train_time(cfg: Config, plan: Plan, work: Workload, thr: Throughput) -> TrainTime:
    epochs = cfg.algo.epochs_per_rollout
    factor = 6 * epochs + (2 * epochs if cfg.model.recompute == "full" else 0)
    factor += 0 if cfg.algo.old_logprob_source == "rollout" else 2
    tokens = plan.tokens.trained_sequences_per_step * work.sequence_tokens
    flops = float(factor) * plan.model.activated_params * tokens
    gpus = plan.hardware.world_size
    return TrainTime(gpus=gpus, tokens=tokens, flops_per_param_token=factor,
                     params=plan.model.activated_params, flops=flops, seconds=flops / (gpus * thr.flops))


def generation_time(plan: Plan, work: Workload, thr: Throughput, links: Links) -> GenTime:
    pool, n = plan.rollout.sglang, plan.model.activated_params
    if pool is None or pool.engines < 1:
        raise ValueError("generation_time needs an SGLang pool with engines")
    fits = pool.kv_pool_tokens_per_engine // work.sequence_tokens
    seqs = pool.sequences_per_round_per_engine
    concurrent = max(min(seqs, fits, pool.requested_concurrency or seqs), 1)
    waves = math.ceil(seqs / concurrent)
    steps = waves * work.response_tokens
    kv = concurrent * (work.prompt_tokens + work.response_tokens / 2) * pool.kv_bytes_per_token_gpu
    read = pool.weights + kv
    flops = 2.0 * n * concurrent / pool.sglang_tp
    memory_s, compute_s = read / (links.hbm * 1e9 * thr.hbm_util), flops / thr.flops
    step_s = max(memory_s, compute_s)
    prompts = math.ceil(plan.tokens.generation_prompts_per_round / pool.engines)
    prefill_s = 2.0 * n * prompts * work.prompt_tokens / (pool.sglang_tp * thr.flops)
    decode_s = steps * step_s
    return GenTime(engines=pool.engines, sglang_tp=pool.sglang_tp, sequences_per_engine=seqs,
                   concurrent=concurrent, waves=waves, decode_steps=steps, bytes_per_step=read,
                   flops_per_step=flops, step_s=step_s,
                   bound="memory" if memory_s >= compute_s else "compute",
                   decode_s=decode_s, prefill_s=prefill_s, rounds=work.gen_rounds,
                   seconds=work.gen_rounds * (decode_s + prefill_s))


def sync_time(refit: Refit, links: Links, *, same_node: bool) -> SyncTime:
    link, gbs = ("NVLink", links.nvlink) if same_node else ("IB", links.ib)
    return SyncTime(refit_s=refit.seconds, model_bytes=refit.model_bytes, link=link,
                    transfer_s=refit.model_bytes / (gbs * 1e9))


def estimate(cfg: Config, plan: Plan, work: Workload, thr: Throughput, links: Links, *,
             same_node: bool) -> Estimate:
    """The three sides' seconds for a plan whose actor is the training side and whose SGLang pool is the
    generation side's (make_plan(..., rollout_hw=...))."""
    if plan.refit is None:
        raise ValueError("estimate needs a plan with a refit (rollout.engine=sglang)")
    return Estimate(train=train_time(cfg, plan, work, thr),
                    generation=generation_time(plan, work, thr, links),
                    sync=sync_time(plan.refit, links, same_node=same_node))
