"""The ONE name/shape map between Hugging Face Qwen2/Qwen2.5/Llama and Megatron GPTModel tensors.

Used by checkpoint conversion (tools/), by loading the actor from an HF dir, and by rollout weight
sync. Plain torch: no Megatron import. Layouts:
- fused QKV: Megatron groups rows per KV head: [q heads of group g; k_g; v_g] for g in KV groups,
  so a TP shard (a contiguous chunk of rows) holds whole groups;
- fc1 = [gate; up]; under TP each rank holds [gate shard; up shard];
- embeddings / lm_head are padded to the padded vocab and split by rows over TP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from megatron_dapo.actor.model import ModelSpec

Kind = Literal["replicated", "column", "row", "qkv", "qkv_bias", "fc1", "vocab"]


@dataclass(frozen=True)
class TensorRule:
    """One Megatron parameter (local name on its pipeline stage) and the HF tensors it is made of."""

    megatron_name: str
    hf_names: tuple[str, ...]
    kind: Kind
    exported: bool = True
    """False for a copy that HF does not store (tied lm_head on a later pipeline stage)."""


def layer_range(spec: ModelSpec, pp_rank: int, pp_size: int) -> range:
    per_stage = spec.num_layers // pp_size
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def stage_rules(spec: ModelSpec, pp_rank: int = 0, pp_size: int = 1, *, te: bool = False) -> list[TensorRule]:
    """Every parameter of one pipeline stage, in a fixed order."""
    rules: list[TensorRule] = []
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    if first:
        rules.append(TensorRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"))
    for local, layer in enumerate(layer_range(spec, pp_rank, pp_size)):
        rules += _layer_rules(spec, f"decoder.layers.{local}.", f"model.layers.{layer}.", te)
    if last:
        rules.append(TensorRule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
        if not spec.tied_embeddings:
            rules.append(TensorRule("output_layer.weight", ("lm_head.weight",), "vocab"))
        elif not first:  # Megatron keeps a tied copy of the embeddings on the last stage
            rules.append(TensorRule("output_layer.weight", ("model.embed_tokens.weight",), "vocab", exported=False))
    return rules


def _layer_rules(spec: ModelSpec, m: str, h: str, te: bool) -> list[TensorRule]:
    attn, mlp = f"{h}self_attn.", f"{h}mlp."
    in_norm = f"{m}self_attention.linear_qkv.layer_norm_weight" if te else f"{m}input_layernorm.weight"
    mlp_norm = f"{m}mlp.linear_fc1.layer_norm_weight" if te else f"{m}pre_mlp_layernorm.weight"
    rules = [
        TensorRule(in_norm, (f"{h}input_layernorm.weight",), "replicated"),
        TensorRule(f"{m}self_attention.linear_qkv.weight",
                   (f"{attn}q_proj.weight", f"{attn}k_proj.weight", f"{attn}v_proj.weight"), "qkv"),
        TensorRule(f"{m}self_attention.linear_proj.weight", (f"{attn}o_proj.weight",), "row"),
        TensorRule(mlp_norm, (f"{h}post_attention_layernorm.weight",), "replicated"),
        TensorRule(f"{m}mlp.linear_fc1.weight", (f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight"), "fc1"),
        TensorRule(f"{m}mlp.linear_fc2.weight", (f"{mlp}down_proj.weight",), "row"),
    ]
    if spec.qkv_bias:
        rules.insert(2, TensorRule(f"{m}self_attention.linear_qkv.bias",
                                   (f"{attn}q_proj.bias", f"{attn}k_proj.bias", f"{attn}v_proj.bias"), "qkv_bias"))
    return rules


def hf_names(spec: ModelSpec) -> list[str]:
    """All HF tensor names of the model, in stage order."""
    return [n for r in stage_rules(spec) if r.exported for n in r.hf_names]


def expected_hf_shape(name: str, spec: ModelSpec) -> tuple[int, ...]:
    """The shape an HF tensor must have, from the config alone."""
    h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    leaf = name.rsplit(".", 2)
    key = ".".join(leaf[-2:])
    shapes = {
        "embed_tokens.weight": (spec.vocab_size, h), "lm_head.weight": (spec.vocab_size, h),
        "q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h),
        "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,), "o_proj.weight": (h, q),
        "gate_proj.weight": (spec.ffn_hidden_size, h), "up_proj.weight": (spec.ffn_hidden_size, h),
        "down_proj.weight": (h, spec.ffn_hidden_size),
    }
    return shapes.get(key, (h,))


# --- full (unsharded) tensors: HF <-> Megatron ---------------------------------------------------


def hf_to_megatron(tensors: list[torch.Tensor], rule: TensorRule, spec: ModelSpec) -> torch.Tensor:
    """HF tensors of one rule -> the full Megatron tensor (vocab NOT padded yet)."""
    if rule.kind in ("qkv", "qkv_bias"):
        return _merge_qkv(*tensors, spec)
    if rule.kind == "fc1":
        return torch.cat(tensors, dim=0)
    (t,) = tensors
    return t


def megatron_to_hf(full: torch.Tensor, rule: TensorRule, spec: ModelSpec) -> list[torch.Tensor]:
    """The full Megatron tensor (vocab padding removed) -> HF tensors, in rule.hf_names order."""
    if rule.kind in ("qkv", "qkv_bias"):
        return list(_split_qkv(full, spec))
    if rule.kind == "fc1":
        return list(full.chunk(2, dim=0))
    return [full]


def _merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    g, d = spec.num_kv_heads, spec.head_dim
    rest = q.shape[1:]
    per_group = spec.num_heads // g
    grouped = torch.cat([q.reshape(g, per_group * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)
    return grouped.reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = spec.num_kv_heads, spec.head_dim
    rest = qkv.shape[1:]
    per_group = spec.num_heads // g
    grouped = qkv.reshape(g, (per_group + 2) * d, *rest)
    q, k, v = grouped.split([per_group * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


# --- tensor-parallel shards ----------------------------------------------------------------------


def shard(full: torch.Tensor, rule: TensorRule, tp_rank: int, tp_size: int, padded_vocab: int) -> torch.Tensor:
    """This TP rank's piece of a full Megatron tensor."""
    if rule.kind == "replicated" or tp_size == 1 and rule.kind != "vocab":
        return full
    if rule.kind == "vocab":
        pad = padded_vocab - full.shape[0]
        if pad < 0:
            raise ValueError(f"{rule.megatron_name}: {full.shape[0]} rows exceed padded vocab {padded_vocab}")
        full = torch.cat([full, full.new_zeros(pad, *full.shape[1:])]) if pad else full
        return full.chunk(tp_size, dim=0)[tp_rank]
    if rule.kind == "row":
        return full.chunk(tp_size, dim=1)[tp_rank]
    if rule.kind == "fc1":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]])
    return full.chunk(tp_size, dim=0)[tp_rank]  # column, qkv, qkv_bias: whole KV groups per rank


def unshard(shards: list[torch.Tensor], rule: TensorRule, vocab_size: int) -> torch.Tensor:
    """Inverse of `shard` over all TP ranks' pieces (vocab padding removed)."""
    if rule.kind == "replicated":
        return shards[0]
    if rule.kind == "row":
        return torch.cat(shards, dim=1)
    if rule.kind == "fc1":
        pairs = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([p[0] for p in pairs] + [p[1] for p in pairs])
    full = torch.cat(shards, dim=0)
    return full[:vocab_size] if rule.kind == "vocab" else full
