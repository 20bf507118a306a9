"""`make_plan`: will this config fit on N nodes x G GPUs? Fills the typed `Plan` of `core`, listing
every reason to refuse (a layout that does not divide, a phase that does not fit)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from megatron_dapo.config import Config, ConfigError, data_parallel_size, validate
from megatron_dapo.config.sizing import resolve_micro_batches
from megatron_dapo.loop.colocation import phase_model
from megatron_dapo.plan.core import (Hardware, IdleActor, Layout, Links, ModelSummary, PhaseMemory, Plan,
                                     Refit, RolloutPhase, SGLangPool, StageMemory, TokenBudget, TrainPhase,
                                     fmt_gib)
from megatron_dapo.plan.memory import (activated_params, actor_bytes, kv_bytes_per_token, params_dtype,
                                       stage_activations, stage_expert_params, stage_params, total_params)
from megatron_dapo.plan.refit import plan_refit
from megatron_dapo.types import route_dtype

if TYPE_CHECKING:
    from megatron_dapo.actor.model import ModelSpec


def make_plan(cfg: Config, spec: ModelSpec, hw: Hardware, *, model_source: str = "", config_name: str = "",
              rollout_concurrency: int | None = None, links: Links = Links(),
              rollout_hw: Hardware | None = None) -> Plan:
    """`rollout_hw`: the generation GPUs of a disaggregated split (plan/split.py), where the engine is sized
    and checked; the actor trains on `hw`. None: the engine is sized on `hw`."""
    gen_hw = rollout_hw or hw
    layout = _layout(cfg, spec, hw)
    train = _train_phase(cfg, spec, hw, layout.dp)
    rollout = _rollout_phase(cfg, spec, gen_hw, train.worst, rollout_concurrency)
    refit = plan_refit(cfg, spec, hw, links) if rollout.sglang is not None else None
    phases = phase_memory(cfg, hw, train.worst, rollout, refit)
    problems = [*_config_problems(cfg, spec, hw), *_train_problems(cfg, train.worst, hw),
                *_rollout_problems(cfg, spec, gen_hw, rollout), *_phase_problems(cfg, hw, phases),
                *_receive_problems(cfg, gen_hw, refit)]
    warnings = [*_tp_warnings(cfg, hw), *([] if rollout_hw else _rollout_warnings(cfg))]
    moe = spec.moe
    model = ModelSummary(source=model_source, params=total_params(spec), activated_params=activated_params(spec),
                         layers=spec.num_layers, hidden=spec.hidden_size,
                         ffn=spec.ffn_hidden_size if moe is None else moe.ffn_hidden_size, heads=spec.num_heads,
                         kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, vocab=spec.vocab_size,
                         vocab_padded=spec.padded_vocab_size(layout.tp), tied_embeddings=spec.tied_embeddings,
                         experts=moe.num_experts if moe else 0, experts_per_token=moe.top_k if moe else 0)
    return Plan(config=config_name, hardware=hw, model=model, layout=layout, train=train, rollout=rollout,
                tokens=_tokens(cfg, spec, layout.dp, resolve_micro_batches(cfg.actor, spec.vocab_size, layout.tp,
                                                                           on_gpu=True).micro_batch_tokens),
                phases=phases, problems=tuple(problems), warnings=tuple(warnings), refit=refit)


def phase_memory(cfg: Config, hw: Hardware, worst: StageMemory, rollout: RolloutPhase,
                 refit: Refit | None = None) -> tuple[PhaseMemory, ...]:
    """Every phase of the phase model (loop/colocation.py, what the trainer follows) on one GPU of the
    worst stage: the components the model puts on the device, sized. The engine is sized for colocated
    SGLang only (the embedded engine is the CPU test bed; a separate fleet is not on these GPUs). The sync
    phase also holds the weight sync's bucket buffers (`refit.sync_buffer_bytes`) while it streams."""
    model = phase_model(colocate=cfg.rollout.colocate, offload_when_idle=cfg.actor.offload_when_idle)
    actor = worst.components
    engine = rollout.sglang.components if rollout.sglang is not None and rollout.colocate else {}
    buffers = {"weight_sync_buckets": refit.sync_buffer_bytes} if refit is not None else {}
    return tuple(PhaseMemory(name=p.name, reserve=hw.reserve_bytes,
                             actor={c: actor[c] for c in p.actor + p.actor_transient} | (
                                 buffers if p.name == "sync" else {}),
                             engine={c: engine[c] for c in p.engine if c in engine})
                 for p in model.values())


def _layout(cfg: Config, spec: ModelSpec, hw: Hardware) -> Layout:
    par, world = cfg.parallel, hw.world_size
    tp, pp = par.tensor_parallel, par.pipeline_parallel
    divides = not (spec.num_layers % pp or world % (tp * pp))
    return Layout(world_size=world, tp=tp, pp=pp, ep=par.expert_parallel,
                  dp=data_parallel_size(cfg, world) if divides else max(world // (tp * pp), 1),
                  sequence_parallel=par.sequence_parallel, recompute=cfg.model.recompute,
                  distributed_optimizer=cfg.actor.optimizer.distributed_optimizer, dtype=params_dtype(cfg),
                  layers_per_stage=spec.num_layers // pp if spec.num_layers % pp == 0 else None)


def _config_problems(cfg: Config, spec: ModelSpec, hw: Hardware) -> list[str]:
    from megatron_dapo.actor.model import UnsupportedModelError, validate_layout

    problems: list[str] = []
    try:
        validate(cfg, hw.world_size)
    except ConfigError as e:
        problems += list(e.problems)
    tp, pp, ep = cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel, cfg.parallel.expert_parallel
    try:
        validate_layout(spec, tp, pp, ep)
    except UnsupportedModelError as e:
        problems.append(f"model does not split at TP={tp}, PP={pp}, EP={ep}: {e}")
    if spec.moe is not None and tp > 1 and not cfg.parallel.sequence_parallel:
        problems.append(f"a MoE model trains at tensor_parallel={tp} only with parallel.sequence_parallel=true "
                        f"(megatron-core refuses MoE + TP without it); or use expert_parallel instead of TP")
    return problems


def _tp_warnings(cfg: Config, hw: Hardware) -> list[str]:
    tp = cfg.parallel.tensor_parallel
    if tp > hw.gpus_per_node:
        return [f"actor TP={tp} spans nodes (gpus_per_node={hw.gpus_per_node}): TP all-reduces "
                f"go over the network; keep TP inside a node"]
    if hw.gpus_per_node % tp:
        return [f"actor TP={tp} does not divide gpus_per_node={hw.gpus_per_node}: some TP groups span nodes"]
    return []


# ------------------------------------------------------------------------------------ train phase


def _train_phase(cfg: Config, spec: ModelSpec, hw: Hardware, dp: int) -> TrainPhase:
    per_param, par = actor_bytes(cfg), cfg.parallel
    tp, pp, ep = par.tensor_parallel, par.pipeline_parallel, par.expert_parallel
    shards = dp if cfg.actor.optimizer.distributed_optimizer else 1
    experts = stage_expert_params(spec, tp, pp, ep)  # sharded over the expert-data-parallel ranks
    expert_shards = max(shards // ep, 1)
    stages = []
    for i, params in enumerate(stage_params(spec, tp, pp, ep)):
        act = stage_activations(spec, cfg, i)
        optimizer = per_param.optimizer * ((params - experts) / shards + experts / expert_shards)
        stages.append(StageMemory(
            stage=i, params=params, weights=per_param.weights * params,
            main_grads=per_param.main_grads * params, optimizer=optimizer,
            activations_train=act.train, activations_logprob=act.logprob, train_tokens=act.train_tokens,
            logprob_tokens=act.logprob_tokens, reserve=hw.reserve_bytes))
    return TrainPhase(stages=tuple(stages))


def _train_problems(cfg: Config, worst: StageMemory, hw: Hardware) -> list[str]:
    if worst.total <= hw.budget_bytes:
        return []
    g = fmt_gib
    dist_opt = cfg.actor.optimizer.distributed_optimizer
    return [f"train phase needs {g(worst.total)} GiB per GPU > {hw.limit_text} "
            f"(stage {worst.stage}: weights {g(worst.weights)} + main grads {g(worst.main_grads)} + "
            f"optimizer {g(worst.optimizer)} + activations {g(worst.activations)} + reserve "
            f"{g(worst.reserve)}); use more GPUs (DP shards the optimizer"
            f"{'' if dist_opt else ' once actor.optimizer.distributed_optimizer=true'}), a larger PP, "
            f"or a smaller actor.micro_batch_tokens"]


# ---------------------------------------------------------------------------------- rollout phase


def _engines_per_node(cfg: Config, hw: Hardware) -> int:
    sg = cfg.rollout.sglang
    return sg.num_servers or max(hw.gpus_per_node // sg.tensor_parallel, 1)


def _sequence_tokens(cfg: Config) -> int:
    return cfg.rollout.max_prompt_len + cfg.rollout.max_response_len


def _generation_prompts(cfg: Config) -> int:
    return math.ceil(cfg.algo.gen_batch_multiplier * cfg.train.prompt_batch_size)


def _sglang_pool(cfg: Config, spec: ModelSpec, hw: Hardware, concurrency: int | None) -> SGLangPool:
    sg, world, seq = cfg.rollout.sglang, hw.world_size, _sequence_tokens(cfg)
    stp, per_node = sg.tensor_parallel, _engines_per_node(cfg, hw)
    engines = max(world // hw.gpus_per_node, 1) * per_node if world % stp == 0 else 0
    kv_engine, kv_gpu = kv_bytes_per_token(spec, stp)
    weights, static = 2 * total_params(spec) / stp, sg.mem_fraction_static * hw.gpu_bytes
    pool_tokens = max(int((static - weights) // kv_gpu), 0)
    pool_seqs = pool_tokens // seq
    per_engine = math.ceil(_generation_prompts(cfg) * cfg.algo.group_size / engines) if engines else 0
    return SGLangPool(
        sglang_tp=stp, engines=engines, engines_per_node=per_node if engines else 0, weights=weights,
        static_pool=static, kv_bytes_per_token_engine=kv_engine, kv_bytes_per_token_gpu=kv_gpu,
        kv_pool_tokens_per_engine=pool_tokens, max_sequence_tokens=seq,
        worst_case_sequences_in_flight=pool_seqs, sequences_per_round_per_engine=per_engine,
        worst_case_waves_per_round=math.ceil(per_engine / pool_seqs) if pool_seqs else None,
        requested_concurrency=concurrency,
        requested_kv=None if concurrency is None else concurrency * seq * kv_gpu)


def _rollout_phase(cfg: Config, spec: ModelSpec, hw: Hardware, worst: StageMemory,
                   concurrency: int | None) -> RolloutPhase:
    r = cfg.rollout
    if r.engine != "sglang":
        return RolloutPhase(engine=r.engine, colocate=r.colocate)
    pool = _sglang_pool(cfg, spec, hw, concurrency)
    if not r.colocate:
        return RolloutPhase(engine=r.engine, colocate=r.colocate, sglang=pool)
    idle = phase_model(colocate=True, offload_when_idle=cfg.actor.offload_when_idle)["generate"].actor
    resident = sum(worst.components[c] for c in idle)
    offload = not idle
    actor = IdleActor(resident=resident, offloaded=offload,
                      host_offload_per_node=worst.state * hw.gpus_per_node if offload else 0.0)
    return RolloutPhase(engine=r.engine, colocate=r.colocate, sglang=pool, actor=actor,
                        reserve=hw.reserve_bytes)


def _rollout_problems(cfg: Config, spec: ModelSpec, hw: Hardware, rollout: RolloutPhase) -> list[str]:
    if rollout.sglang is None:
        return []
    return [*_sglang_layout_problems(cfg, spec, hw), *_kv_pool_problems(cfg, hw, rollout.sglang)]


def _sglang_layout_problems(cfg: Config, spec: ModelSpec, hw: Hardware) -> list[str]:
    stp, world, gpn = cfg.rollout.sglang.tensor_parallel, hw.world_size, hw.gpus_per_node
    per_node = _engines_per_node(cfg, hw)
    problems = []
    if world % stp:
        problems.append(f"rollout.sglang.tensor_parallel={stp} does not divide the {world} GPUs")
    if per_node * stp > gpn:
        problems.append(f"rollout.sglang.num_servers={per_node} x tensor_parallel={stp} needs "
                        f"{per_node * stp} GPUs per node; a node has {gpn}")
    if cfg.rollout.colocate and gpn % stp:
        problems.append(f"rollout.sglang.tensor_parallel={stp} must divide gpus_per_node={gpn} "
                        f"(a colocated engine lives on one node)")
    if spec.num_heads % stp:
        problems.append(f"rollout.sglang.tensor_parallel={stp} does not divide the "
                        f"{spec.num_heads} attention heads")
    return problems


def _kv_pool_problems(cfg: Config, hw: Hardware, pool: SGLangPool) -> list[str]:
    g, frac, seq = fmt_gib, cfg.rollout.sglang.mem_fraction_static, pool.max_sequence_tokens
    problems = []
    if pool.kv_pool <= 0:
        problems.append(
            f"SGLang weights ({g(pool.weights)} GiB per GPU at sglang TP={pool.sglang_tp}) do not fit in "
            f"mem_fraction_static x GPU = {frac} x {hw.gpu_mem_gib:g} = {g(pool.static_pool)} GiB; "
            f"raise rollout.sglang.tensor_parallel or mem_fraction_static")
    elif pool.worst_case_sequences_in_flight < 1:
        problems.append(
            f"SGLang KV pool ({g(pool.kv_pool)} GiB per GPU = {pool.kv_pool_tokens_per_engine} tokens per "
            f"engine) cannot hold one worst-case sequence of {seq} tokens "
            f"(max_prompt_len + max_response_len)")
    if pool.requested_kv is not None and pool.requested_kv > max(pool.kv_pool, 0):
        problems.append(
            f"--rollout-concurrency {pool.requested_concurrency} worst-case sequences x {seq} tokens need "
            f"{g(pool.requested_kv)} GiB of KV per GPU > the pool's {g(max(pool.kv_pool, 0))} GiB "
            f"(at most {pool.worst_case_sequences_in_flight} fit)")
    return problems


def _phase_problems(cfg: Config, hw: Hardware, phases: tuple[PhaseMemory, ...]) -> list[str]:
    """generate and sync over the budget (train has its own, more specific message)."""
    problems = []
    for p in phases:
        buckets = "weight_sync_buckets" in p.actor
        if p.name == "train" or not (p.engine or buckets) or p.total <= hw.budget_bytes:
            continue
        parts = [f"{side} {name} {fmt_gib(v)}" for side, comp in (("actor", p.actor), ("engine", p.engine))
                 for name, v in comp.items()]
        hint = " (actor.offload_when_idle=false)" if p.name == "generate" and p.actor else ""
        if buckets and p.total - p.actor["weight_sync_buckets"] <= hw.budget_bytes:  # the buckets tip it over
            held = "one bucket" if cfg.rollout.sglang.weight_sync == "disk" else "a bucket and its flat copy"
            hint = (f"; weight_sync_buckets: {held} of rollout.weight_sync_bucket_mb="
                    f"{cfg.rollout.bucket_mb()} (at least the largest tensor): lower it")
        problems.append(f"{p.name} phase needs {fmt_gib(p.total)} GiB per GPU > {hw.limit_text} "
                        f"({' + '.join(parts)} + reserve {fmt_gib(p.reserve)}){hint}")
    return problems


def _receive_problems(cfg: Config, hw: Hardware, refit: Refit | None) -> list[str]:
    """distributed (servers on their own GPUs, KV cache resident): each bucket's receive buffer must fit
    beside SGLang's static pool."""
    sg = cfg.rollout.sglang
    if refit is None or cfg.rollout.colocate or sg.weight_sync != "distributed":
        return []
    free = (1 - sg.mem_fraction_static) * hw.gpu_bytes - hw.reserve_bytes
    if refit.bucket_bytes <= free:
        return []
    return [f"a weight-sync bucket of {fmt_gib(refit.bucket_bytes)} GiB does not fit beside the servers' "
            f"static pool (1 - mem_fraction_static {sg.mem_fraction_static}) x {hw.gpu_mem_gib:g} GiB - "
            f"reserve = {fmt_gib(free)} GiB: lower rollout.weight_sync_bucket_mb"]


def _rollout_warnings(cfg: Config) -> list[str]:
    r = cfg.rollout
    if r.engine != "sglang":
        return [f"rollout.engine={r.engine}: the in-process engine is the CPU test bed; no KV sizing"]
    if not r.colocate:
        return ["rollout.colocate=false: the rollout GPUs are not part of this config, so only the "
                "actor is sized here"]
    return []


# ----------------------------------------------------------------------------------------- tokens


def _tokens(cfg: Config, spec: ModelSpec, dp: int, micro_batch_tokens: int) -> TokenBudget:
    a, t, seq = cfg.algo, cfg.train, _sequence_tokens(cfg)
    updates = a.epochs_per_rollout * t.prompt_batch_size // max(t.mini_batch_size, 1)
    trained_seqs = t.prompt_batch_size * a.group_size
    gen_prompts = _generation_prompts(cfg)
    per_token = 0
    if spec.moe is not None and cfg.actor.routing_replay == "r3":
        per_token = spec.num_layers * spec.moe.top_k * route_dtype(spec.moe.num_experts).itemsize
    return TokenBudget(
        route_bytes_per_step_max=trained_seqs * seq * per_token,
        route_bytes_per_dp_rank_max=trained_seqs * seq // max(dp, 1) * per_token,
        route_bytes_held_max=(1 + cfg.rollout.async_steps) * trained_seqs * seq * per_token,
        sequence_tokens_max=seq,
        trained_sequences_per_step=trained_seqs,
        trained_tokens_per_step_max=trained_seqs * seq,
        trained_tokens_per_dp_rank_max=trained_seqs * seq // max(dp, 1),
        generation_prompts_per_round=gen_prompts,
        generated_sequences_per_round=gen_prompts * a.group_size,
        generated_tokens_per_round_max=gen_prompts * a.group_size * cfg.rollout.max_response_len,
        max_generation_rounds=a.max_gen_rounds if a.dynamic_sampling else 1,
        updates_per_step=updates,
        sequences_per_update=trained_seqs // max(updates // a.epochs_per_rollout, 1),
        micro_batches_per_update_per_dp_rank_max=math.ceil(
            t.mini_batch_size * a.group_size / max(dp, 1) / max(micro_batch_tokens // seq, 1)))
