"""Dry-run planner: will this config fit on N nodes x G GPUs? No GPU needed.

    python -m megatron_dapo.plan --config examples/configs/dapo_qwen2.5_32b.yaml --nodes 16 --gpus-per-node 8
    python -m megatron_dapo.plan --config ... --nodes 1 --gpus-per-node 8 --gpu-mem-gb 141 --json

Prints the parallel layout (actor TP/PP/DP, SGLang engines), a per-GPU memory estimate for the two
phases of the colocated hybrid engine, tokens per step and updates per step, and REFUSES (exit 1,
every reason listed) a layout that does not divide or cannot fit. Exit 2: the config or model cannot
be read. The model's size comes from `--model-config` (a config.json or its folder), else
`model.hf_dir`/config.json, else the built-in table `KNOWN_MODELS` (matched by hf_dir's base name).

Memory model (all sizes per GPU, GiB = 2**30 bytes; P = parameters on the GPU's pipeline stage,
sharded by TP; the worst stage counts). A phase is refused when it needs more than
--max-util (default 0.9) x GPU memory: the caching allocator fragments memory and small buffers are
not counted.
  train phase  = weights + main grads + optimizer + activations + reserve
    weights      bf16: 2 B x P            (model.dtype float32: 4 B)
    main grads   fp32: 4 B x P            (Megatron's grad buffer is full size, also with the
                                           distributed optimizer, which reduce-scatters into it)
    optimizer    12 B x P / DP            fp32 master copy + Adam m + v, sharded over DP with
                                          actor.optimizer.distributed_optimizer, else 12 B x P
                                          (float32 params: no master copy, 8 B)
    activations  max(train micro-batch, logprob micro-batch), T = max(token budget, prompt+response)
                 tokens (a longer row goes alone into its micro-batch), a = 2 B (bf16):
       one layer, all tensors kept for backward (SwiGLU, GQA, flash attention, no dropout):
           A(T) = a x T x [ (2h + 2 kv hd + 3 ffn) / TP + 4h / (TP if sequence parallel else 1) ]
           (q,k,v + attention output + gate,up + SwiGLU out are TP-sharded; the inputs of the two
           RMSNorms, of QKV and of FC1 are replicated without SP)
       recompute none/selective: layers_stage x in-flight x A(T) + A(T)   (selective recomputes
           only core attention, which flash attention does not store anyway)
       recompute full: layers_stage x in-flight x a x T x h / (TP if SP else 1) + 2 A(T)
           (checkpointed layer inputs + one layer recomputed in backward, with its gradients)
       in-flight micro-batches on stage i = PP - i (1F1B)
       last stage: logits T x V_padded / TP x a, plus their gradient (a) when training (the
           streaming logprob kernels keep no fp32 [T, V] copy)
       logprob pass (forward only): A(T_lp) + logits(T_lp)
    reserve      --reserve-gb: CUDA contexts (trainer, the sleeping SGLang server), NCCL buffers
  rollout phase (colocated SGLang awake; actor.offload_when_idle moves weights, grads and optimizer
  state to host memory, else they stay) = mem_fraction_static x GPU + actor resident + reserve
    SGLang static pool = engine weights (2 B x params / sglang TP) + KV pool
    KV bytes per token per GPU = 2 (K, V) x layers x KV heads per GPU x head_dim x 2 B (bf16)
       (KV heads per GPU = kv_heads / sglang TP, at least 1: replicated when TP > kv_heads)
    tokens in flight per engine = concurrent sequences x (max_prompt_len + max_response_len);
    by default the planner reports how many worst-case sequences the pool holds; with
    --rollout-concurrency N it checks that N worst-case sequences fit.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from megatron_dapo.config import Config, ConfigError, data_parallel_size, load_config, validate

GIB = 2**30
EXIT_REFUSED = 1
EXIT_BAD_INPUT = 2

# Architecture numbers of known models, as in their public Hugging Face config.json files
# (huggingface.co/Qwen/<name>/blob/main/config.json): same field names, so they go through the
# same `spec_from_hf` as a real checkpoint's config.
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen2.5-32B: 64 layers, hidden 5120, FFN 27648, 40 query heads, 8 KV heads (GQA),
    # vocab 152064, untied embeddings; 32.76 B parameters (65.5 GB of bf16 safetensors).
    "Qwen2.5-32B": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu",
                        hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                        max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-05,
                        tie_word_embeddings=False, use_sliding_window=False),
    # Qwen/Qwen2.5-7B: 28 layers, hidden 3584, FFN 18944, 28 query heads, 4 KV heads, vocab 152064, untied.
    "Qwen2.5-7B": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu",
                       hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-06,
                       tie_word_embeddings=False, use_sliding_window=False),
    # Qwen/Qwen2.5-1.5B: 28 layers, hidden 1536, FFN 8960, 12 query heads, 2 KV heads, vocab 151936, tied.
    "Qwen2.5-1.5B": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu",
                         hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-06,
                         tie_word_embeddings=True, use_sliding_window=False),
}


class PlanInputError(ValueError):
    """The model cannot be determined or is unsupported (exit 2)."""


@dataclass(frozen=True)
class Hardware:
    nodes: int
    gpus_per_node: int
    gpu_mem_gib: float = 80.0
    reserve_gib: float = 4.0
    max_util: float = 0.9

    @property
    def budget_gib(self) -> float:
        return self.gpu_mem_gib * self.max_util

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class Plan:
    """Everything the planner found; `problems` non-empty = refused."""

    config: str
    hardware: dict[str, Any]
    model: dict[str, Any]
    layout: dict[str, Any]
    memory: dict[str, Any]
    tokens: dict[str, Any]
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fits": self.fits}


# ------------------------------------------------------------------------------------------ model


def _known_model_key(hf_dir: str | None) -> str | None:
    if not hf_dir:
        return None
    name = Path(hf_dir.rstrip("/")).name.lower()
    for suffix in ("-instruct",):  # same architecture as the base model
        name = name.removesuffix(suffix)
    return next((k for k in KNOWN_MODELS if k.lower() == name), None)


def resolve_model(cfg: Config, model_config: str | Path | None = None) -> tuple[Any, str]:
    """(ModelSpec, where its numbers came from): --model-config, hf_dir/config.json, or the table."""
    from megatron_dapo.actor.model import UnsupportedModelError, spec_from_hf

    if model_config is not None:
        path = Path(model_config)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise PlanInputError(f"--model-config {model_config}: no such config.json")
        fields, source = json.loads(path.read_text()), str(path)
    elif cfg.model.hf_dir and (Path(cfg.model.hf_dir) / "config.json").is_file():
        path = Path(cfg.model.hf_dir) / "config.json"
        fields, source = json.loads(path.read_text()), str(path)
    else:
        key = _known_model_key(cfg.model.hf_dir)
        if key is None:
            raise PlanInputError(
                f"model.hf_dir={cfg.model.hf_dir!r} has no config.json here and is not a built-in model "
                f"({', '.join(KNOWN_MODELS)}): pass --model-config PATH/config.json")
        fields = KNOWN_MODELS[key]
        source = f"built-in table: {key} (model.hf_dir={cfg.model.hf_dir}/config.json not found here)"
    try:
        return spec_from_hf(SimpleNamespace(**fields)), source
    except (UnsupportedModelError, AttributeError, TypeError) as e:
        raise PlanInputError(f"{source}: {e}") from e


def layer_params(spec: Any) -> tuple[int, int]:
    """(TP-sharded, replicated) parameters of one transformer layer."""
    h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    qkv = h * (q + 2 * kv) + ((q + 2 * kv) if spec.qkv_bias else 0)
    sharded = qkv + q * h + 3 * h * spec.ffn_hidden_size  # QKV, output proj, SwiGLU gate+up and down
    return sharded, 2 * h  # the two RMSNorm weights are replicated over TP


def total_params(spec: Any) -> int:
    """Parameters of the Hugging Face model (unpadded vocabulary)."""
    sharded, repl = layer_params(spec)
    embed = spec.vocab_size * spec.hidden_size
    head = 0 if spec.tied_embeddings else embed
    return spec.num_layers * (sharded + repl) + embed + head + spec.hidden_size


def stage_params(spec: Any, tp: int, pp: int) -> list[int]:
    """Parameters on ONE GPU of each pipeline stage (Megatron layout, padded vocabulary)."""
    sharded, repl = layer_params(spec)
    layers = spec.num_layers // pp
    vocab_shard = spec.padded_vocab_size(tp) * spec.hidden_size // tp
    out = []
    for stage in range(pp):
        n = layers * (sharded // tp + repl)
        if stage == 0:
            n += vocab_shard  # word embeddings
        if stage == pp - 1:
            n += spec.hidden_size  # final norm
            if not spec.tied_embeddings or pp > 1:  # tied + PP>1: the last stage keeps a copy
                n += vocab_shard
        out.append(n)
    return out


# ------------------------------------------------------------------------------------ activations


def layer_activation_bytes(spec: Any, tokens: int, tp: int, seq_parallel: bool, act_bytes: int) -> float:
    """A(T): one layer's activations kept for backward (see the module docstring)."""
    h, kvhd, ffn = spec.hidden_size, spec.num_kv_heads * spec.head_dim, spec.ffn_hidden_size
    sharded = 2 * h + 2 * kvhd + 3 * ffn
    replicated = 4 * h
    return act_bytes * tokens * (sharded / tp + replicated / (tp if seq_parallel else 1))


def logits_bytes(spec: Any, tokens: int, tp: int, act_bytes: int, *, with_grad: bool) -> float:
    return tokens * spec.padded_vocab_size(tp) / tp * act_bytes * (2 if with_grad else 1)


def stage_activation_bytes(spec: Any, cfg: Config, stage: int) -> dict[str, float]:
    par = cfg.parallel
    tp, pp, sp = par.tensor_parallel, par.pipeline_parallel, par.sequence_parallel
    a = _act_bytes(cfg)
    seq = cfg.rollout.max_prompt_len + cfg.rollout.max_response_len
    t_train = max(cfg.actor.micro_batch_tokens, seq)
    t_lp = max(cfg.actor.logprob_micro_batch_tokens, seq)
    layers, in_flight = spec.num_layers // pp, pp - stage
    last = stage == pp - 1
    one_layer = layer_activation_bytes(spec, t_train, tp, sp, a)
    if cfg.model.recompute == "full":
        kept = layers * in_flight * a * t_train * spec.hidden_size / (tp if sp else 1) + 2 * one_layer
    else:
        kept = layers * in_flight * one_layer + one_layer
    train = kept + (logits_bytes(spec, t_train, tp, a, with_grad=True) if last else 0.0)
    logprob = layer_activation_bytes(spec, t_lp, tp, sp, a) + (
        logits_bytes(spec, t_lp, tp, a, with_grad=False) if last else 0.0)
    return {"train": train, "logprob": logprob, "peak": max(train, logprob),
            "train_tokens": t_train, "logprob_tokens": t_lp}


def _act_bytes(cfg: Config) -> int:
    return 4 if cfg.model.dtype == "float32" else 2  # auto = bf16 on GPU


# ------------------------------------------------------------------------------------------- plan


def make_plan(cfg: Config, spec: Any, hw: Hardware, *, model_source: str = "", config_name: str = "",
              rollout_concurrency: int | None = None) -> Plan:
    from megatron_dapo.actor.model import UnsupportedModelError, validate_layout

    problems: list[str] = []
    warnings: list[str] = []
    par, r, sg = cfg.parallel, cfg.rollout, cfg.rollout.sglang
    tp, pp, world = par.tensor_parallel, par.pipeline_parallel, hw.world_size
    gpu = hw.gpu_mem_gib * GIB
    budget = hw.budget_gib * GIB
    limit = f"{hw.max_util:g} x {hw.gpu_mem_gib:g} = {hw.budget_gib:.1f} GiB"
    reserve = hw.reserve_gib * GIB

    # ---- divisibility
    try:
        validate(cfg, world)
    except ConfigError as e:
        problems += [line.strip().removeprefix("- ") for line in str(e).splitlines()[1:]]
    try:
        validate_layout(spec, tp, pp)
    except UnsupportedModelError as e:
        problems.append(f"model does not split at TP={tp}, PP={pp}: {e}")
    if spec.num_layers % pp or world % (tp * pp):
        dp = max(world // (tp * pp), 1)
    else:
        dp = data_parallel_size(cfg, world)
    if tp > hw.gpus_per_node:
        warnings.append(f"actor TP={tp} spans nodes (gpus_per_node={hw.gpus_per_node}): TP all-reduces "
                        f"go over the network; keep TP inside a node")
    elif hw.gpus_per_node % tp:
        warnings.append(f"actor TP={tp} does not divide gpus_per_node={hw.gpus_per_node}: "
                        "some TP groups span nodes")
    if sg.mem_fraction_static <= 0 or sg.mem_fraction_static >= 1:
        problems.append(f"rollout.sglang.mem_fraction_static={sg.mem_fraction_static} must be in (0, 1)")

    # ---- actor memory, worst pipeline stage
    dtype = "float32" if cfg.model.dtype == "float32" else "bfloat16"
    w_b, g_b = (4, 4) if dtype == "float32" else (2, 4)
    opt_b = 8 if dtype == "float32" else 12
    dist_opt = cfg.actor.optimizer.distributed_optimizer
    per_stage = stage_params(spec, tp, pp)
    stages = []
    for i, params in enumerate(per_stage):
        act = stage_activation_bytes(spec, cfg, i)
        weights, grads = w_b * params, g_b * params
        optim = opt_b * params / (dp if dist_opt else 1)
        stages.append({"stage": i, "params": params, "weights": weights, "main_grads": grads,
                       "optimizer": optim, "activations": act["peak"], "activations_train": act["train"],
                       "activations_logprob": act["logprob"], "reserve": reserve,
                       "total": weights + grads + optim + act["peak"] + reserve,
                       "train_tokens": act["train_tokens"], "logprob_tokens": act["logprob_tokens"]})
    worst = max(stages, key=lambda s: s["total"])
    static = worst["weights"] + worst["main_grads"] + worst["optimizer"]
    train_phase = dict(worst)
    if train_phase["total"] > budget:
        problems.append(
            f"train phase needs {_g(train_phase['total'])} GiB per GPU > {limit} "
            f"(stage {worst['stage']}: weights {_g(worst['weights'])} + "
            f"main grads {_g(worst['main_grads'])} + "
            f"optimizer {_g(worst['optimizer'])} + activations {_g(worst['activations'])} + reserve "
            f"{_g(reserve)}); use more GPUs (DP shards the optimizer"
            f"{'' if dist_opt else ' once actor.optimizer.distributed_optimizer=true'}), a larger PP, "
            f"or a smaller actor.micro_batch_tokens")

    # ---- rollout (colocated SGLang)
    seq = r.max_prompt_len + r.max_response_len
    gen_prompts = math.ceil(cfg.algo.gen_batch_multiplier * cfg.train.prompt_batch_size)
    round_seqs = gen_prompts * cfg.algo.group_size
    rollout: dict[str, Any] = {"engine": r.engine, "colocate": r.colocate}
    rollout_phase_total = 0.0
    if r.engine == "sglang":
        stp = sg.tensor_parallel
        nodes = max(world // hw.gpus_per_node, 1)
        per_node = sg.num_servers or max(hw.gpus_per_node // stp, 1)
        engines = nodes * per_node if world % stp == 0 else 0
        if world % stp:
            problems.append(f"rollout.sglang.tensor_parallel={stp} does not divide the {world} GPUs")
        if per_node * stp > hw.gpus_per_node:
            problems.append(f"rollout.sglang.num_servers={per_node} x tensor_parallel={stp} needs "
                            f"{per_node * stp} GPUs per node; a node has {hw.gpus_per_node}")
        if r.colocate and hw.gpus_per_node % stp:
            problems.append(f"rollout.sglang.tensor_parallel={stp} must divide "
                            f"gpus_per_node={hw.gpus_per_node} "
                            f"(a colocated engine lives on one node)")
        if spec.num_heads % stp:
            problems.append(f"rollout.sglang.tensor_parallel={stp} does not divide the "
                            f"{spec.num_heads} attention heads")
        kv_heads_gpu = max(1, spec.num_kv_heads // stp)
        kv_per_token_engine = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2
        kv_per_token_gpu = 2 * spec.num_layers * kv_heads_gpu * spec.head_dim * 2
        sg_weights = 2 * total_params(spec) / stp
        sg_static = sg.mem_fraction_static * gpu
        kv_pool = sg_static - sg_weights
        pool_tokens = max(int(kv_pool // kv_per_token_gpu), 0)
        pool_seqs = pool_tokens // seq
        per_engine = math.ceil(round_seqs / engines) if engines else 0
        rollout.update({
            "sglang_tp": stp, "engines": engines,
            "engines_per_node": per_node if engines else 0,
            "weights": sg_weights, "static_pool": sg_static, "kv_pool": kv_pool,
            "kv_bytes_per_token_engine": kv_per_token_engine, "kv_bytes_per_token_gpu": kv_per_token_gpu,
            "kv_pool_tokens_per_engine": pool_tokens, "max_sequence_tokens": seq,
            "worst_case_sequences_in_flight": pool_seqs, "sequences_per_round_per_engine": per_engine,
            "worst_case_waves_per_round": math.ceil(per_engine / pool_seqs) if pool_seqs else None,
        })
        if kv_pool <= 0:
            problems.append(
                f"SGLang weights ({_g(sg_weights)} GiB per GPU at sglang TP={stp}) do not fit in "
                f"mem_fraction_static x GPU = {sg.mem_fraction_static} x {hw.gpu_mem_gib:g} = "
                f"{_g(sg_static)} GiB; "
                f"raise rollout.sglang.tensor_parallel or mem_fraction_static")
        elif pool_seqs < 1:
            problems.append(
                f"SGLang KV pool ({_g(kv_pool)} GiB per GPU = {pool_tokens} tokens per engine) "
                f"cannot hold one "
                f"worst-case sequence of {seq} tokens (max_prompt_len + max_response_len)")
        if rollout_concurrency is not None:
            need = rollout_concurrency * seq * kv_per_token_gpu
            rollout["requested_concurrency"] = rollout_concurrency
            rollout["requested_kv"] = need
            if need > max(kv_pool, 0):
                problems.append(
                    f"--rollout-concurrency {rollout_concurrency} worst-case sequences x {seq} tokens need "
                    f"{_g(need)} GiB of KV per GPU > the pool's {_g(max(kv_pool, 0))} GiB "
                    f"(at most {pool_seqs} fit)")
        if r.colocate:
            offload = cfg.actor.offload_when_idle
            resident = 0.0 if offload else static
            rollout_phase_total = sg_static + resident + reserve
            rollout.update({"actor_resident": resident, "actor_offloaded": offload, "reserve": reserve,
                            "total": rollout_phase_total,
                            "host_offload_per_node": static * hw.gpus_per_node if offload else 0.0})
            if rollout_phase_total > budget:
                problems.append(
                    f"rollout phase needs {_g(rollout_phase_total)} GiB per GPU > {limit} "
                    f"(SGLang {sg.mem_fraction_static} x {hw.gpu_mem_gib:g} + actor resident {_g(resident)}"
                    f"{'' if offload else ' (actor.offload_when_idle=false)'} + reserve {_g(reserve)})")
        else:
            warnings.append("rollout.colocate=false: the rollout GPUs are not part of this config, "
                            "so only the "
                            "actor is sized here")
    else:
        warnings.append(f"rollout.engine={r.engine}: the in-process engine is the CPU test bed; no KV sizing")

    # ---- tokens and updates
    updates = cfg.algo.epochs_per_rollout * cfg.train.prompt_batch_size // max(cfg.train.mini_batch_size, 1)
    trained_seqs = cfg.train.prompt_batch_size * cfg.algo.group_size
    tokens = {
        "sequence_tokens_max": seq,
        "trained_sequences_per_step": trained_seqs,
        "trained_tokens_per_step_max": trained_seqs * seq,
        "trained_tokens_per_dp_rank_max": trained_seqs * seq // max(dp, 1),
        "generation_prompts_per_round": gen_prompts,
        "generated_sequences_per_round": round_seqs,
        "generated_tokens_per_round_max": round_seqs * r.max_response_len,
        "max_generation_rounds": cfg.algo.max_gen_rounds if cfg.algo.dynamic_sampling else 1,
        "updates_per_step": updates,
        "sequences_per_update": trained_seqs // max(updates // cfg.algo.epochs_per_rollout, 1),
        "micro_batches_per_update_per_dp_rank_max": math.ceil(
            cfg.train.mini_batch_size * cfg.algo.group_size / max(dp, 1)
            / max(cfg.actor.micro_batch_tokens // seq, 1)),
    }
    layout = {"world_size": world, "tp": tp, "pp": pp, "dp": dp, "sequence_parallel": par.sequence_parallel,
              "recompute": cfg.model.recompute, "distributed_optimizer": dist_opt, "dtype": dtype,
              "layers_per_stage": spec.num_layers // pp if spec.num_layers % pp == 0 else None}
    model = {"source": model_source, "params": total_params(spec), "layers": spec.num_layers,
             "hidden": spec.hidden_size, "ffn": spec.ffn_hidden_size, "heads": spec.num_heads,
             "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "vocab": spec.vocab_size,
             "vocab_padded": spec.padded_vocab_size(tp), "tied_embeddings": spec.tied_embeddings}
    memory = {"gpu": gpu, "budget": budget, "train_phase": train_phase, "stages": stages,
              "rollout_phase": rollout}
    return Plan(config=config_name, hardware=asdict(hw) | {"world_size": world}, model=model, layout=layout,
                memory=memory, tokens=tokens, problems=problems, warnings=warnings)


# ------------------------------------------------------------------------------------------ output


def _g(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}"


# --------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_dapo.plan",
                                description="Plan a megatron-dapo run: layout, per-GPU memory, "
                                            "tokens per step; "
                                            "refuse layouts that cannot fit or do not divide (exit 1).")
    p.add_argument("--config", required=True, help="YAML config (deltas over the defaults)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.pipeline_parallel=2")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--gpu-mem-gb", type=float, default=80.0,
                   help="memory per GPU in GiB (H100: 80, H200: 141)")
    p.add_argument("--reserve-gb", type=float, default=4.0,
                   help="per-GPU GiB set aside for the CUDA context, NCCL buffers and fragmentation")
    p.add_argument("--max-util", type=float, default=0.9,
                   help="refuse a phase that needs more than this fraction of GPU memory "
                        "(fragmentation headroom)")
    p.add_argument("--model-config", help="HF config.json (or its folder) to size the model from")
    p.add_argument("--rollout-concurrency", type=int, default=None,
                   help="check that this many worst-case sequences per SGLang engine fit the KV pool")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (args.nodes < 1 or args.gpus_per_node < 1 or args.gpu_mem_gb <= 0 or args.reserve_gb < 0
            or not 0 < args.max_util <= 1):
        print("plan: --nodes and --gpus-per-node must be >= 1, --gpu-mem-gb > 0, --reserve-gb >= 0, "
              "--max-util in (0, 1]", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        cfg = load_config(args.config, args.overrides)
        spec, source = resolve_model(cfg, args.model_config)
    except (ConfigError, PlanInputError) as e:
        print(f"plan: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    hw = Hardware(args.nodes, args.gpus_per_node, args.gpu_mem_gb, args.reserve_gb, args.max_util)
    plan = make_plan(cfg, spec, hw, model_source=source, config_name=args.config,
                     rollout_concurrency=args.rollout_concurrency)
    from megatron_dapo.plan_report import format_plan

    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    if not plan.fits:
        if args.json:
            print("plan: REFUSED:\n  - " + "\n  - ".join(plan.problems), file=sys.stderr)
        return EXIT_REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main())
