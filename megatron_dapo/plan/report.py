"""The planner's human-readable report (`python -m megatron_dapo.plan` without --json)."""

from __future__ import annotations

from megatron_dapo.plan.core import PUBLISHED_REFIT, PhaseMemory, Plan, RolloutPhase, SGLangPool
from megatron_dapo.plan.core import fmt_gib as _g


def fmt_count(x: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:g}"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def format_plan(plan: Plan) -> str:
    lines = _header(plan)
    for phase in plan.phases:  # the phase model's order: generate, train, sync
        if phase.name == "generate":
            lines += _generate_lines(plan, plan.rollout, phase)
        elif phase.name == "train":
            lines += _train_lines(plan, phase)
        else:
            lines += _sync_lines(plan, phase)
    lines += _refit_lines(plan)
    lines += _token_lines(plan)
    lines += [f"warning: {w}" for w in plan.warnings]
    lines.append("")
    if plan.fits:
        lines.append("verdict: FITS")
    else:
        lines.append("verdict: REFUSED")
        lines += [f"  - {p}" for p in plan.problems]
    return "\n".join(lines)


def _planned(plan: Plan) -> str:
    return f"{plan.hardware.budget_gib:.1f}"


def _header(plan: Plan) -> list[str]:
    hw, m, lay, ro = plan.hardware, plan.model, plan.layout, plan.rollout
    on_off = "on" if lay.sequence_parallel else "off"
    optim = "distributed" if lay.distributed_optimizer else "replicated"
    lines = [
        f"plan: {plan.config} on {hw.nodes} node(s) x {hw.gpus_per_node} GPUs = {hw.world_size} GPUs "
        f"of {hw.gpu_mem_gib:g} GiB (planned to {hw.max_util:g} of it: {_planned(plan)} GiB)",
        f"model: {fmt_count(m.params)} params, {m.layers} layers, hidden {m.hidden}, FFN {m.ffn}, "
        f"{m.heads} heads / {m.kv_heads} KV heads x {m.head_dim}, vocab {m.vocab} "
        f"(padded {m.vocab_padded}), {'tied' if m.tied_embeddings else 'untied'} embeddings",
        *([f"       MoE: {m.experts} experts of FFN {m.ffn}, top-{m.experts_per_token} per token: "
            f"{fmt_count(m.activated_params)} params activated per token"] if m.experts else []),
        f"       from {m.source}",
        "",
        "layout",
        f"  actor    TP={lay.tp} x PP={lay.pp} x DP={lay.dp} = {lay.world_size}"
        f"{f' (experts: EP={lay.ep} of the DP ranks)' if lay.ep > 1 else ''}; "
        f"{lay.layers_per_stage} layers per stage; sequence parallel {on_off}; recompute {lay.recompute}; "
        f"{optim} optimizer; {lay.dtype} params",
    ]
    if ro.sglang is not None:
        where = "colocated" if ro.colocate else "separate GPUs"
        lines.append(f"  rollout  SGLang, {where}: {ro.sglang.engines} engines x TP={ro.sglang.sglang_tp} "
                     f"({ro.sglang.engines_per_node} per node)")
    else:
        lines.append(f"  rollout  {ro.engine} engine")
    return lines


def _total(plan: Plan, phase: PhaseMemory) -> str:
    return f"  total         {_g(phase.total):>8}   of {_planned(plan)} planned"


def _sync_lines(plan: Plan, phase: PhaseMemory) -> list[str]:
    buckets = phase.actor.get("weight_sync_buckets", 0.0)
    actor = sum(phase.actor.values()) - buckets
    parts = " + ".join(c.replace("_", " ") for c in phase.actor if c != "weight_sync_buckets")
    lines = ["", "per-GPU memory, sync phase (actor state + the engine's weights, not its KV cache), GiB",
             f"  actor         {_g(actor):>8}   {parts}"]
    if plan.refit is not None:
        lines.append(f"  sync buckets  {_g(buckets):>8}   the largest bucket's gathered tensors and flat "
                     f"copy ({_g(plan.refit.largest_bucket_bytes)}: rollout.weight_sync_bucket_mb or the "
                     f"largest tensor)")
    if "weights" in phase.engine:
        lines.append(f"  SGLang weights{_g(phase.engine['weights']):>8}   resumed without the KV cache")
    return lines + [f"  reserve       {_g(phase.reserve):>8}", _total(plan, phase)]


def _refit_lines(plan: Plan) -> list[str]:
    r = plan.refit
    if r is None:
        return []
    return [
        "",
        "refit (weight sync into the SGLang servers, node-local, expected)",
        f"  bytes         {_gb(r.model_bytes)} in {r.buckets} buckets of {_g(r.bucket_bytes)} GiB; per GPU: "
        f"TP all-gather {_gb(r.tp_gather_bytes)} over {r.tp_link}, experts {_gb(r.ep_receive_bytes)} over "
        f"{r.ep_link}, other stages {_gb(r.pp_receive_bytes)} over {r.pp_link}; "
        f"{_gb(r.cross_node_bytes_per_node)} per node from other nodes",
        f"  seconds       {r.seconds:.2f} s = gather {r.gather_s:.2f} + bucket copies {r.copy_s:.2f} + "
        f"per-bucket overhead {r.overhead_s:.2f} (--nvlink-gbs, --ib-gbs, --hbm-gbs, --bucket-overhead-ms)",
        f"  published     {PUBLISHED_REFIT}",
    ]


def _train_lines(plan: Plan, phase: PhaseMemory) -> list[str]:
    lay, tr = plan.layout, plan.train.worst
    dp_note = f" / DP {lay.dp}" if lay.distributed_optimizer else ""
    w_bytes, o_bytes = (2, 12) if lay.dtype == "bfloat16" else (4, 8)
    return [
        "",
        f"per-GPU memory, train phase (worst stage: {tr.stage}), GiB",
        f"  weights       {_g(tr.weights):>8}   {w_bytes} B x {fmt_count(tr.params)} params on this GPU",
        f"  main grads    {_g(tr.main_grads):>8}   fp32, 4 B x params",
        f"  optimizer     {_g(tr.optimizer):>8}   {o_bytes} B x params{dp_note} (fp32 master + Adam m, v)",
        f"  activations   {_g(tr.activations):>8}   max(train {_g(tr.activations_train)} @ "
        f"{tr.train_tokens} tokens, logprob {_g(tr.activations_logprob)} @ {tr.logprob_tokens} tokens), "
        f"recompute {lay.recompute}",
        f"  reserve       {_g(tr.reserve):>8}   CUDA contexts, NCCL buffers (--reserve-gb)",
        _total(plan, phase),
    ]


def _generate_lines(plan: Plan, ro: RolloutPhase, phase: PhaseMemory) -> list[str]:
    if ro.sglang is None or not ro.colocate:
        where = "not sized" if ro.sglang is None else "on other GPUs"
        return ["", f"per-GPU memory, generate phase ({ro.engine} engine: {where}), GiB",
                f"  actor         {_g(sum(phase.actor.values())):>8}   weights + grads + optimizer stay",
                f"  reserve       {_g(phase.reserve):>8}", _total(plan, phase)]
    return _sglang_lines(plan, ro, ro.sglang, phase)


def _sglang_lines(plan: Plan, ro: RolloutPhase, sg: SGLangPool, phase: PhaseMemory) -> list[str]:
    m = plan.model
    kv_heads_gpu = max(1, m.kv_heads // sg.sglang_tp)
    lines = [
        "",
        "per-GPU memory, generate phase (SGLang awake), GiB",
        f"  SGLang pool   {_g(sg.static_pool):>8}   mem_fraction_static x GPU",
        f"    weights     {_g(sg.weights):>8}   2 B x {fmt_count(m.params)} / sglang TP {sg.sglang_tp}",
        f"    KV cache    {_g(sg.kv_pool):>8}   {sg.kv_bytes_per_token_gpu} B/token/GPU "
        f"(2 x {m.layers} layers x {kv_heads_gpu} KV heads x {m.head_dim} x 2 B; "
        f"{sg.kv_bytes_per_token_engine} B/token per engine) = "
        f"{fmt_count(sg.kv_pool_tokens_per_engine)} tokens per engine",
    ]
    if ro.actor is not None:
        if ro.actor.offloaded:
            actor = (f"offloaded to host (actor.offload_when_idle): "
                     f"{_g(ro.actor.host_offload_per_node)} GiB host RAM per node")
        else:
            actor = "weights + grads + optimizer stay on the GPU"
        lines += [
            f"  actor         {_g(ro.actor.resident):>8}   {actor}",
            f"  reserve       {_g(ro.reserve):>8}",
            _total(plan, phase),
        ]
    waves = sg.worst_case_waves_per_round
    lines.append(
        f"  in flight: {sg.worst_case_sequences_in_flight} worst-case sequences "
        f"({sg.max_sequence_tokens} tokens) per engine; a generation round is "
        f"{sg.sequences_per_round_per_engine} sequences per engine"
        + (f" (>= {waves} waves if all ran to the limit)" if waves else ""))
    if sg.requested_concurrency is not None and sg.requested_kv is not None:
        lines.append(f"  --rollout-concurrency {sg.requested_concurrency}: "
                     f"KV {_g(sg.requested_kv)} GiB per GPU")
    return lines


def _token_lines(plan: Plan) -> list[str]:
    tok = plan.tokens
    return [
        "",
        "tokens per step (upper bounds: every sequence at max_prompt_len + max_response_len)",
        f"  trained     {tok.trained_sequences_per_step} sequences x {tok.sequence_tokens_max} = "
        f"{fmt_count(tok.trained_tokens_per_step_max)} tokens "
        f"({fmt_count(tok.trained_tokens_per_dp_rank_max)} per DP rank)",
        f"  generated   {tok.generation_prompts_per_round} prompts x G per round = "
        f"{tok.generated_sequences_per_round} sequences, <= {fmt_count(tok.generated_tokens_per_round_max)} "
        f"response tokens; <= {tok.max_generation_rounds} rounds",
        f"  updates     {tok.updates_per_step} optimizer update(s) per step "
        f"({tok.sequences_per_update} sequences each, "
        f"<= {tok.micro_batches_per_update_per_dp_rank_max} micro-batches per DP rank)",
    ] + ([f"  routes      r3: the rollout's routes of the trained tokens, {_g(tok.route_bytes_per_step_max)} GiB "
          f"per step ({_g(tok.route_bytes_per_dp_rank_max)} GiB per DP rank, scattered and held with its rows); "
          f"the driver holds {_g(tok.route_bytes_held_max)} GiB (this step's and the pipeline's batches: a checkpoint "
          "writes them)"]
         if tok.route_bytes_per_step_max else [])
