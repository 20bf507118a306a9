"""What the actor builds, read from a Hugging Face config: the model's shape (`ModelSpec`, with `MoESpec` for the
mixture-of-experts Qwen2-MoE and Qwen3-MoE), refused features named by field, and the layouts it divides into."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
