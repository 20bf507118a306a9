"""A Megatron-core GPTModel built from a Hugging Face config: Qwen2 / Qwen2.5 / Llama / Qwen3 (QK-norm) and
the mixture-of-experts Qwen2-MoE (shared expert with a sigmoid gate) and Qwen3-MoE (megatron-core MoE layers,
expert parallel)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from megatron_dapo import megatron_cpu, parallel
from megatron_dapo.config import ModelConfig, ParallelConfig

SUPPORTED_ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3",
                           "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe"}
_QK_NORM = ("qwen3", "qwen3_moe")


class UnsupportedModelError(ValueError):
    """The HF config uses a feature this actor does not implement; the message names the field."""


@dataclass(frozen=True)
class MoESpec:
    """The mixture-of-experts MLP of every layer (Qwen2-MoE / Qwen3-MoE)."""

    num_experts: int
    top_k: int
    ffn_hidden_size: int
    """moe_intermediate_size: one routed expert's FFN width."""
    norm_topk_prob: bool
    """Renormalise the top-k router probabilities to sum to 1 (else the softmax over all experts)."""
    shared_expert_size: int = 0
    """Qwen2-MoE: FFN width of the shared expert every token goes through, scaled by a sigmoid gate; 0 = none."""


@dataclass(frozen=True)
class ModelSpec:
    """What the actor needs to know about the architecture, read off the HF config."""

    family: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    norm_eps: float
    qkv_bias: bool
    tied_embeddings: bool
    qk_norm: bool = False
    """Qwen3: per-head RMSNorm of queries and keys before RoPE."""
    moe: MoESpec | None = None

    def attention_pair_cost(self) -> float:
        """FLOPs of one query-key pair in attention (scores and weighted values) over one token's FLOPs in a
        layer's linear maps (QKV, output, MLP; an MoE layer counted as one dense expert)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        linear = self.hidden_size * (q + 2 * kv) + q * self.hidden_size + 3 * self.hidden_size * self.ffn_hidden_size
        return 2 * q / linear

    def padded_vocab_size(self, tp: int, divisible_by: int = 128) -> int:
        """Megatron pads the vocab so each TP shard has the same size (a multiple of divisible_by)."""
        multiple = divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)


def load_hf_config(hf: str | Path | Any) -> Any:
    """A transformers PretrainedConfig from a directory, or passed through."""
    if isinstance(hf, (str, Path)):
        from transformers import AutoConfig

        if not (Path(hf) / "config.json").is_file():
            raise FileNotFoundError(f"no config.json in {hf}")
        return AutoConfig.from_pretrained(str(hf))
    return hf


def spec_from_hf(hf_config: Any) -> ModelSpec:
    """Validate an HF config and read the fields we map; unsupported features fail by name."""
    arch = (getattr(hf_config, "architectures", None) or [None])[0]
    model_type = getattr(hf_config, "model_type", None)
    family = SUPPORTED_ARCHITECTURES.get(arch) or {f: f for f in SUPPORTED_ARCHITECTURES.values()}.get(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"architectures={arch!r} / model_type={model_type!r}: supported are {sorted(SUPPORTED_ARCHITECTURES)}")
    _reject(hf_config, "hidden_act", lambda v: v != "silu", "only SwiGLU (hidden_act='silu') is supported")
    _reject(hf_config, "rope_scaling", lambda v: bool(v) and _rope_type(v) != "default",
            "rope scaling is not supported")
    _reject(hf_config, "use_sliding_window", bool, "sliding-window attention is not supported")
    _reject(hf_config, "mlp_bias", bool, "MLP biases are not supported")
    heads, kv = hf_config.num_attention_heads, getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    if heads % kv:
        raise UnsupportedModelError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    return ModelSpec(
        family=family, num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        vocab_size=hf_config.vocab_size, max_position_embeddings=hf_config.max_position_embeddings,
        rope_theta=float(_rope_theta(hf_config)), norm_eps=float(hf_config.rms_norm_eps),
        qkv_bias=_qkv_bias(hf_config, family), tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qk_norm=family in _QK_NORM, moe=_moe_from_hf(hf_config) if family.endswith("_moe") else None)


def _qkv_bias(hf_config: Any, family: str) -> bool:
    if family == "qwen2":
        return True
    if family == "qwen2_moe":
        return bool(getattr(hf_config, "qkv_bias", True))
    # Llama / Qwen3: attention_bias also gives o_proj a bias, which Megatron's linear_proj does not have
    _reject(hf_config, "attention_bias", bool, "attention biases (q/k/v/o_proj) are not supported for this family")
    return False


def _moe_from_hf(hf_config: Any) -> MoESpec:
    """Every layer sparse, softmax top-k routing; Megatron's aux / z losses stay off (DAPO has none)."""
    _reject(hf_config, "decoder_sparse_step", lambda v: v != 1, "only every layer sparse (decoder_sparse_step=1) "
            "is supported")
    _reject(hf_config, "mlp_only_layers", bool, "dense MLP layers inside a MoE model are not supported")
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    top_k = hf_config.num_experts_per_tok
    if not experts or not 0 < top_k <= experts:
        raise UnsupportedModelError(f"num_experts={experts}, num_experts_per_tok={top_k}: need 0 < top-k <= experts")
    shared = int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)
    return MoESpec(num_experts=int(experts), top_k=int(top_k), ffn_hidden_size=int(hf_config.moe_intermediate_size),
                   norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)), shared_expert_size=shared)


def _rope_type(rope_scaling: dict) -> str:
    return rope_scaling.get("rope_type", rope_scaling.get("type", "default"))


def _rope_theta(hf_config: Any) -> float:
    theta = getattr(hf_config, "rope_theta", None)
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    return theta if theta is not None else params.get("rope_theta", 10000.0)


def _reject(cfg: Any, name: str, bad, why: str) -> None:
    value = getattr(cfg, name, None)
    if value is not None and bad(value):
        raise UnsupportedModelError(f"{name}={value!r}: {why}")


def validate_layout(spec: ModelSpec, tp: int, pp: int, ep: int = 1) -> None:
    """TP must divide heads, KV groups and FFN widths; PP the layers; EP the experts."""
    checks = {"num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads}
    if spec.moe is None:
        checks["intermediate_size"] = spec.ffn_hidden_size
    else:  # the experts are TP-sharded too (Megatron's expert TP defaults to TP)
        checks["moe_intermediate_size"] = spec.moe.ffn_hidden_size
        if spec.moe.shared_expert_size:
            checks["shared_expert_intermediate_size"] = spec.moe.shared_expert_size
    for name, value in checks.items():
        if value % tp:
            raise UnsupportedModelError(f"{name}={value} is not divisible by tensor_parallel={tp}")
    if spec.num_layers % pp:
        raise UnsupportedModelError(f"num_hidden_layers={spec.num_layers} is not divisible by pipeline_parallel={pp}")
    if ep > 1 and spec.moe is None:
        raise UnsupportedModelError(f"expert_parallel={ep} needs a mixture-of-experts model ({spec.family} is dense)")
    if spec.moe is not None and spec.moe.num_experts % ep:
        raise UnsupportedModelError(f"num_experts={spec.moe.num_experts} is not divisible by expert_parallel={ep}")


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
        **_moe_fields(spec.moe), **_init_methods(init_weights), **recompute[model_cfg.recompute])


def _moe_fields(moe: MoESpec | None) -> dict[str, Any]:
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
                moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None, moe_input_jitter_eps=None, moe_grouped_gemm=False,
                moe_permute_fusion=False, moe_router_dtype="fp32",
                moe_enable_routing_replay=True)  # each router consults its replay (actor/routing.py)


def layer_spec(model_cfg: ModelConfig, spec: ModelSpec) -> Any:
    """The transformer layer: Transformer Engine's when it is there, else Megatron's local one. MoE layers
    use Megatron's sequential experts with either spec, so expert parameters and checkpoint keys are the
    same in both (the local MoE spec keeps `pre_mlp_layernorm` under its own key, as TE's does)."""
    from megatron.core.models.gpt import gpt_layer_specs

    experts = spec.moe.num_experts if spec.moe else None
    kw = dict(num_experts=experts, moe_grouped_gemm=False, qk_layernorm=spec.qk_norm)
    if use_transformer_engine(model_cfg):
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**kw)
    layer = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", **kw)
    if model_cfg.local_attention == "sdpa":
        from megatron_dapo.actor.attention import SDPAttention

        layer.submodules.self_attention.submodules.core_attention = SDPAttention
    if experts:
        keys = layer.submodules.sharded_state_dict_keys_map
        layer.submodules.sharded_state_dict_keys_map = {k: v for k, v in keys.items() if k != "pre_mlp_layernorm."}
    return layer


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
    model = GPTModel(
        config=transformer_config(spec, model_cfg, par, init_weights=init_weights),
        transformer_layer_spec=layer_spec(model_cfg, spec),
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
