"""A Megatron-core GPTModel built from a Hugging Face config (model_spec.py reads its shape): Qwen2 / Qwen2.5 / Llama /
Qwen3 (QK-norm) and the mixture-of-experts Qwen2-MoE (shared expert with a sigmoid gate) and Qwen3-MoE (megatron-core
MoE layers, expert parallel); the kernels its layers run (Transformer Engine's or the local spec's, fused rotary
embedding, grouped experts)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from megatron_dapo import megatron_cpu, parallel
from megatron_dapo.actor.model_spec import (  # noqa: F401 - the model's shape lives there; importers use either
    SUPPORTED_ARCHITECTURES,
    MoESpec,
    ModelSpec,
    UnsupportedModelError,
    load_hf_config,
    spec_from_hf,
    validate_layout,
)
from megatron_dapo.config import ModelConfig, ParallelConfig

def param_dtype(cfg: ModelConfig) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]


def attention_kernel(cfg: ModelConfig) -> str:
    """The core attention and the rotary embedding the actor's layers run, as the start-up summary names them."""
    rope = "rotary embedding " + ("fused (Transformer Engine)" if rope_fusion(cfg) else "unfused (megatron-core)")
    if use_transformer_engine(cfg):
        return f"Transformer Engine's, {rope}"
    return ("torch SDPA" if cfg.local_attention == "sdpa" else "Megatron's unfused") + \
        f" (model.local_attention={cfg.local_attention}), {rope}"


def grouped_experts(cfg: ModelConfig, spec: ModelSpec) -> bool:
    """Whether the routed experts run as one grouped GEMM per layer (Transformer Engine's GroupedLinear, in
    TEGroupedMLP) instead of megatron-core's SequentialMLP, a Python loop of two small matmuls per expert.
    Both keep the same distributed-checkpoint keys; their parameter names differ (hf_mapping.stage_rules)."""
    if spec.moe is None or cfg.moe_experts == "sequential":
        return False
    available = use_transformer_engine(cfg) and _te_grouped_linear()
    if cfg.moe_experts == "grouped" and not available:
        raise UnsupportedModelError("model.moe_experts=grouped runs the experts in Transformer Engine's GroupedLinear, "
                                    "which needs the Transformer Engine layer spec on CUDA: set model.moe_experts=auto "
                                    "or sequential")
    return available


def _te_grouped_linear() -> bool:
    try:
        from megatron.core.extensions.transformer_engine import TEColumnParallelGroupedLinear
    except ImportError:
        return False
    return TEColumnParallelGroupedLinear is not None


def expert_kernel(cfg: ModelConfig, spec: ModelSpec) -> str:
    """The routed experts' kernel, as the start-up summary names it ("" for a dense model)."""
    if spec.moe is None:
        return ""
    how = "grouped GEMM (Transformer Engine's GroupedLinear)" if grouped_experts(cfg, spec) \
        else "sequential (megatron-core's loop over the local experts)"
    return f"{how}, model.moe_experts={cfg.moe_experts}"


def rope_fusion(cfg: ModelConfig) -> bool:
    """Transformer Engine's fused rotary embedding, wherever its layer spec is in use. megatron-core 0.16.1's
    unfused one syncs the device (`.tolist()`, `.item()`) and loops in Python over the packed sequences in
    every layer. Not with the local spec: `rotary_positions` feeds per-row angles, which TE's kernel (one angle
    table for the whole batch) would misapply."""
    if not use_transformer_engine(cfg):
        return False
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils.fused_apply_rotary_pos_emb is not None and rope_utils.fused_apply_rotary_pos_emb_thd is not None


def packs_sequences(cfg: ModelConfig, par: ParallelConfig) -> int:
    """`micro_batches`' thd: rows packed without padding (Megatron's thd format) in sequences of a multiple of
    this length (the TP size with sequence parallelism, else 1), or 0 = a padded batch. Transformer Engine's
    and torch SDPA's attention take it, Megatron's unfused one does not. Expert parallelism takes it too: its
    ranks agree on their micro-batch count whatever the packing (Actor._agree_on_count)."""
    if not (use_transformer_engine(cfg) or cfg.local_attention == "sdpa"):
        return 0
    return par.tensor_parallel if par.sequence_parallel else 1


def use_transformer_engine(cfg: ModelConfig) -> bool:
    if cfg.transformer_impl == "local":
        return False
    try:
        import transformer_engine  # noqa: F401

        available = torch.cuda.is_available()
    except ImportError:
        available = False
    if cfg.transformer_impl == "transformer_engine" and not available:
        raise RuntimeError("model.transformer_impl=transformer_engine but transformer_engine (with CUDA) is not available")
    return available


def keep_as_allocated(weight: torch.Tensor) -> torch.Tensor:
    """The init_method of a model whose weights are about to be loaded: leaves them as they are."""
    return weight


def _init_methods(init_weights: bool) -> dict[str, Any]:
    """Megatron's random init, or a no-op one. Never perform_initialization=False: megatron-core 0.16
    then also skips `set_tensor_model_parallel_attributes`, and without the `tensor_model_parallel`
    flag the grad norm (clipping) counts only TP rank 0's shards. The no-op keeps every other step of
    Megatron's initialisation, so the parameters carry exactly the flags of a randomly initialised model."""
    if init_weights:
        return {}
    names = ("init_method", "output_layer_init_method", "embedding_init_method")
    return dict.fromkeys(names, keep_as_allocated)


def transformer_config(spec: ModelSpec, model_cfg: ModelConfig, par: ParallelConfig, *,
                       init_weights: bool = True) -> Any:
    from megatron.core.transformer import TransformerConfig

    dtype = param_dtype(model_cfg)
    recompute: dict[str, dict[str, Any]] = {"none": {}, "selective": {"recompute_granularity": "selective"},
                 "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}}
    return TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_heads, num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim,
        normalization="RMSNorm", layernorm_epsilon=spec.norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0, attention_softmax_in_fp32=True,
        qk_layernorm=spec.qk_norm,
        tensor_model_parallel_size=par.tensor_parallel, pipeline_model_parallel_size=par.pipeline_parallel,
        expert_model_parallel_size=par.expert_parallel, sequence_parallel=par.sequence_parallel,
        params_dtype=dtype, bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype, use_cpu_initialization=megatron_cpu.is_enabled(),
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=rope_fusion(model_cfg), persist_layer_norm=False, gradient_accumulation_fusion=False,
        batch_p2p_comm=not megatron_cpu.is_enabled(),
        # micro-batches are packed by a token budget, so their shapes differ; (the allgather MoE
        # dispatcher refuses variable lengths even in a dense model, hence alltoall)
        variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
        # our loss is normalised by the global token count: Megatron must not rescale it
        calculate_per_token_loss=True,
        # train.deterministic (loop/determinism.py) switches torch's; Megatron's and TE's kernels follow
        deterministic_mode=torch.are_deterministic_algorithms_enabled(),
        **_moe_fields(spec.moe, grouped_experts(model_cfg, spec)), **_init_methods(init_weights), **recompute[model_cfg.recompute])


def _moe_fields(moe: MoESpec | None, grouped: bool) -> dict[str, Any]:
    """Megatron's MoE settings for HF's router: softmax over the experts, top-k; with norm_topk_prob the
    top-k logits are softmaxed among themselves (= renormalised probabilities), else the probabilities
    of the softmax over all experts are used as they are (`pre_softmax`). No load-balancing aux loss and
    no z-loss: they would add gradients the DAPO objective does not have. The router in fp32: Megatron's default
    (the model's dtype) rounds a pre-softmax router's probabilities to bf16 before the top-k, where transformers
    and SGLang pick from fp32 probabilities: near-ties went to other experts than in the rollout
    (tests/test_moe_router.py)."""
    if moe is None:
        return {}
    return dict(num_moe_experts=moe.num_experts, moe_ffn_hidden_size=moe.ffn_hidden_size, moe_router_topk=moe.top_k,
                moe_router_score_function="softmax", moe_router_pre_softmax=not moe.norm_topk_prob,
                moe_shared_expert_intermediate_size=moe.shared_expert_size or None,
                moe_shared_expert_gate=bool(moe.shared_expert_size), moe_router_load_balancing_type="none",
                moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None, moe_input_jitter_eps=None, moe_grouped_gemm=grouped,
                moe_permute_fusion=False, moe_router_dtype="fp32",
                moe_enable_routing_replay=True)  # each router consults its replay (actor/routing.py)


def layer_spec(model_cfg: ModelConfig, spec: ModelSpec) -> Any:
    """The transformer layer: Transformer Engine's when it is there, else Megatron's local one. MoE layers
    run their experts grouped or sequential (`grouped_experts`); both keep the same checkpoint keys (the local
    MoE spec keeps `pre_mlp_layernorm` under its own key, as TE's does)."""
    from megatron.core.models.gpt import gpt_layer_specs

    experts = spec.moe.num_experts if spec.moe else None
    kw = dict(num_experts=experts, moe_grouped_gemm=grouped_experts(model_cfg, spec), qk_layernorm=spec.qk_norm)
    if use_transformer_engine(model_cfg):
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**kw)
    layer = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", **kw)
    layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = RMSNorm
    attention = layer.submodules.self_attention.submodules
    if spec.qk_norm:
        attention.q_layernorm = attention.k_layernorm = RMSNorm
    if model_cfg.local_attention == "sdpa":
        from megatron_dapo.actor.attention import SDPAttention

        layer.submodules.self_attention.submodules.core_attention = SDPAttention
    if experts:
        keys = layer.submodules.sharded_state_dict_keys_map
        layer.submodules.sharded_state_dict_keys_map = {k: v for k, v in keys.items() if k != "pre_mlp_layernorm."}
    return layer


class RMSNorm(torch.nn.RMSNorm):
    """The local spec's norm: torch's RMSNorm (megatron-core's wrapper of it refuses sequence parallelism). With
    sequence parallelism each TP rank normalises its slice of the sequence, so the weight is marked, as Transformer
    Engine's norms mark theirs, for Megatron to sum its gradient over the TP ranks (finalize_model_grads)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_unused: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]


def block_spec(model_cfg: ModelConfig, spec: ModelSpec, config: Any) -> Any:
    """This pipeline stage's layers and, with the local spec, its final norm (RMSNorm; TE's block picks TE's)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer = layer_spec(model_cfg, spec)
    if use_transformer_engine(model_cfg):
        return layer
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=RMSNorm)


def _define_missing_te_gemm() -> None:
    """megatron-core 0.16.1's MoE router reads `te_general_gemm` even when its Transformer Engine import
    failed (NameError without TE): None selects its torch matmul path."""
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_model(spec: ModelSpec, model_cfg: ModelConfig, par: ParallelConfig, *, init_weights: bool = True) -> Any:
    """The GPTModel chunk of this pipeline stage (parallel state must be initialised).

    init_weights=False skips the random initialisation (weights are about to be loaded)."""
    from megatron.core.models.gpt import GPTModel

    validate_layout(spec, par.tensor_parallel, par.pipeline_parallel, par.expert_parallel)
    if spec.moe is not None:
        _define_missing_te_gemm()
    config = transformer_config(spec, model_cfg, par, init_weights=init_weights)
    model = GPTModel(
        config=config, transformer_layer_spec=block_spec(model_cfg, spec, config),
        vocab_size=spec.padded_vocab_size(par.tensor_parallel),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=parallel.is_first_stage(), post_process=parallel.is_last_stage(),
        parallel_output=True, share_embeddings_and_output_weights=spec.tied_embeddings,
        position_embedding_type="rope", rotary_base=int(spec.rope_theta), rotary_percent=1.0)
    _cast_params(model, model.config.params_dtype)
    return model.to(parallel.device())


def _cast_params(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every parameter in the model's dtype, as Megatron-LM's Float16Module and TE's layers make them. The
    local spec's norms ignore params_dtype (fp32 in a bf16 model); megatron-core's fp16/bf16 optimizer then
    pairs its state with the wrong parameters and the first checkpoint save fails on a shape mismatch."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def output_weight(model: Any) -> torch.Tensor:
    """The last stage's output-layer weight [V_padded / TP, H] (the word embeddings when tied)."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def _hidden_passthrough(hidden_states: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None):
    return hidden_states, None


@contextmanager
def final_hidden_states(model: Any) -> Iterator[None]:
    """Inside, the last pipeline stage returns its final (normed) hidden states [b, s, H] instead of
    logits: the output layer is skipped so that the loss can fuse it (kernels.linear_logprobs_and_entropy).
    Other stages are unchanged. Not with sequence parallelism (the hidden states are sequence-sharded)."""
    layer = getattr(model, "output_layer", None) if model.post_process else None
    if layer is None:
        yield
        return
    layer.forward = _hidden_passthrough  # an instance attribute shadows the class's forward
    try:
        yield
    finally:
        del layer.forward


@contextmanager
def rotary_positions(model: Any, position_ids: torch.Tensor | None) -> Iterator[None]:
    """Inside, `model`'s rotary embedding rotates token (b, s) by position_ids[b, s] instead of s: megatron-core
    0.16.1's GPTModel ignores position_ids for RoPE (it rotates by 0..s-1). The angles come from Megatron's
    own table, so a row whose position_ids are 0..s-1 gets exactly the default rotation. None: unchanged."""
    rope = getattr(model, "rotary_pos_emb", None)
    if position_ids is None or rope is None:
        yield
        return
    if model.config.apply_rope_fusion:
        raise RuntimeError("per-row rotary positions need the unfused rotary embedding: TE's fused kernel applies "
                           "one angle table to every row (rope_fusion)")
    table = type(rope).forward(rope, int(position_ids.max()) + 1)  # [positions, 1, 1, dim]
    freqs = table[position_ids.t().to(table.device), 0]  # [s, b, 1, dim]: broadcast over the heads

    def per_token(*args: Any, **kwargs: Any) -> torch.Tensor:
        return freqs

    rope.forward = per_token  # an instance attribute shadows the class's forward
    try:
        yield
    finally:
        del rope.forward
