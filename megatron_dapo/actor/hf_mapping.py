"""The ONE name/shape map between Hugging Face Qwen2/Qwen2.5/Llama/Qwen3(-MoE)/Qwen2-MoE and Megatron
GPTModel tensors.

Used by checkpoint conversion (tools/), by loading the actor from an HF dir, and by rollout weight
sync. Plain torch: no Megatron import. Layouts:
- fused QKV: Megatron groups rows per KV head: [q heads of group g; k_g; v_g] for g in KV groups,
  so a TP shard (a contiguous chunk of rows) holds whole groups;
- fc1 = [gate; up]; under TP each rank holds [gate shard; up shard] (dense MLP, every expert, the
  shared expert);
- embeddings / lm_head are padded to the padded vocab and split by rows over TP;
- MoE: the router (`mlp.gate`), the shared expert's sigmoid gate and the q/k norms are replicated;
  routed experts are spread over the expert-parallel ranks (EP rank r holds experts
  r*E/EP .. (r+1)*E/EP-1 as `local_experts.0..`) and each is TP-sharded like a dense MLP.
HF names are the checkpoint's (`mlp.experts.<e>.gate_proj.weight`), which SGLang and
`from_pretrained` take; transformers >= 5 fuses them into 3D tensors only in memory.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
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
    expert: int | None = None
    """The global index of the routed expert this tensor belongs to: it lives on one expert-parallel
    rank and is sharded over the expert tensor-parallel group."""


def layer_range(spec: ModelSpec, pp_rank: int, pp_size: int) -> range:
    per_stage = spec.num_layers // pp_size
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


@dataclass(frozen=True)
class Naming:
    """How a built model names its parameters: the Transformer Engine spec fuses the norms into the next
    linear (`te`); grouped experts (TEGroupedMLP) hold expert i's weight as `experts.linear_fc1.weight<i>`
    where the sequential ones (SequentialMLP) have `experts.local_experts.<i>.linear_fc1.weight`."""

    te: bool = False
    grouped: bool = False

    @classmethod
    def of(cls, names: Iterable[str]) -> Naming:
        names = list(names)
        return cls(te=any(n.endswith("layer_norm_weight") for n in names),
                   grouped=any(_GROUPED.search(n) for n in names))


_GROUPED = re.compile(r"\.experts\.linear_fc1\.weight\d+$")


def stage_rules(spec: ModelSpec, pp_rank: int = 0, pp_size: int = 1, *, te: bool = False, grouped: bool = False,
                ep_rank: int = 0, ep_size: int = 1) -> list[TensorRule]:
    """Every parameter of one pipeline stage, in a fixed order; with ep_size > 1 only the routed experts
    of expert-parallel rank `ep_rank` (ep_size=1: all of them, the stage's HF view). `te` and `grouped`: the
    model's `Naming`."""
    rules: list[TensorRule] = []
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    if first:
        rules.append(TensorRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"))
    experts = _local_experts(spec, ep_rank, ep_size)
    for local, layer in enumerate(layer_range(spec, pp_rank, pp_size)):
        rules += _layer_rules(spec, f"decoder.layers.{local}.", f"model.layers.{layer}.", te, experts, grouped)
    if last:
        rules.append(TensorRule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
        if not spec.tied_embeddings:
            rules.append(TensorRule("output_layer.weight", ("lm_head.weight",), "vocab"))
        elif not first:  # Megatron keeps a tied copy of the embeddings on the last stage
            rules.append(TensorRule("output_layer.weight", ("model.embed_tokens.weight",), "vocab", exported=False))
    return rules


def _local_experts(spec: ModelSpec, ep_rank: int, ep_size: int) -> range:
    if spec.moe is None:
        return range(0)
    per_rank = spec.moe.num_experts // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def _layer_rules(spec: ModelSpec, m: str, h: str, te: bool, experts: range, grouped: bool) -> list[TensorRule]:
    attn = f"{h}self_attn."
    in_norm = f"{m}self_attention.linear_qkv.layer_norm_weight" if te else f"{m}input_layernorm.weight"
    # Transformer Engine fuses the pre-MLP norm into a dense fc1; a MoE layer keeps it apart in both specs
    fused_mlp_norm = te and spec.moe is None
    mlp_norm = f"{m}mlp.linear_fc1.layer_norm_weight" if fused_mlp_norm else f"{m}pre_mlp_layernorm.weight"
    rules = [
        TensorRule(in_norm, (f"{h}input_layernorm.weight",), "replicated"),
        TensorRule(f"{m}self_attention.linear_qkv.weight",
                   (f"{attn}q_proj.weight", f"{attn}k_proj.weight", f"{attn}v_proj.weight"), "qkv"),
    ]
    if spec.qkv_bias:
        rules.append(TensorRule(f"{m}self_attention.linear_qkv.bias",
                                (f"{attn}q_proj.bias", f"{attn}k_proj.bias", f"{attn}v_proj.bias"), "qkv_bias"))
    if spec.qk_norm:
        rules += [TensorRule(f"{m}self_attention.q_layernorm.weight", (f"{attn}q_norm.weight",), "replicated"),
                  TensorRule(f"{m}self_attention.k_layernorm.weight", (f"{attn}k_norm.weight",), "replicated")]
    rules += [TensorRule(f"{m}self_attention.linear_proj.weight", (f"{attn}o_proj.weight",), "row"),
              TensorRule(mlp_norm, (f"{h}post_attention_layernorm.weight",), "replicated")]
    if spec.moe is None:
        return rules + _mlp_rules(f"{m}mlp.", f"{h}mlp.")
    return rules + _moe_rules(spec, f"{m}mlp.", f"{h}mlp.", experts, grouped)


def _mlp_rules(m: str, h: str, expert: int | None = None) -> list[TensorRule]:
    return [TensorRule(f"{m}linear_fc1.weight", (f"{h}gate_proj.weight", f"{h}up_proj.weight"), "fc1", expert=expert),
            TensorRule(f"{m}linear_fc2.weight", (f"{h}down_proj.weight",), "row", expert=expert)]


def _moe_rules(spec: ModelSpec, m: str, h: str, experts: range, grouped: bool) -> list[TensorRule]:
    rules = [TensorRule(f"{m}router.weight", (f"{h}gate.weight",), "replicated")]
    for e in experts:
        local, he = e - experts.start, f"{h}experts.{e}."
        if grouped:  # TE's GroupedLinear: one weight per local expert, sharded like the sequential expert's
            rules += [TensorRule(f"{m}experts.linear_fc1.weight{local}", (f"{he}gate_proj.weight", f"{he}up_proj.weight"),
                                 "fc1", expert=e),
                      TensorRule(f"{m}experts.linear_fc2.weight{local}", (f"{he}down_proj.weight",), "row", expert=e)]
        else:
            rules += _mlp_rules(f"{m}experts.local_experts.{local}.", he, expert=e)
    if spec.moe.shared_expert_size:
        rules += _mlp_rules(f"{m}shared_experts.", f"{h}shared_expert.")
        rules.append(TensorRule(f"{m}shared_experts.gate_weight", (f"{h}shared_expert_gate.weight",), "replicated"))
    return rules


def hf_names(spec: ModelSpec) -> list[str]:
    """All HF tensor names of the model, in stage order."""
    return [n for r in stage_rules(spec) if r.exported for n in r.hf_names]


def expected_hf_shape(name: str, spec: ModelSpec) -> tuple[int, ...]:
    """The shape an HF tensor must have, from the config alone."""
    h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    ffn = spec.ffn_hidden_size
    if spec.moe is not None and ".mlp.experts." in name:
        ffn = spec.moe.ffn_hidden_size
    elif spec.moe is not None and ".mlp.shared_expert." in name:
        ffn = spec.moe.shared_expert_size
    key = ".".join(name.rsplit(".", 2)[-2:])
    shapes = {
        "embed_tokens.weight": (spec.vocab_size, h), "lm_head.weight": (spec.vocab_size, h),
        "q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h),
        "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,), "o_proj.weight": (h, q),
        "q_norm.weight": (spec.head_dim,), "k_norm.weight": (spec.head_dim,),
        "gate_proj.weight": (ffn, h), "up_proj.weight": (ffn, h), "down_proj.weight": (h, ffn),
        "gate.weight": (spec.moe.num_experts if spec.moe else 0, h), "shared_expert_gate.weight": (1, h),
    }
    return shapes.get(key, (h,))


def full_shape(rule: TensorRule, spec: ModelSpec) -> tuple[int, ...]:
    """The unpadded full Megatron shape of a rule, derived from the HF shapes through the one map."""
    parts = [torch.empty(expected_hf_shape(n, spec), device="meta") for n in rule.hf_names]
    return tuple(hf_to_megatron(parts, rule, spec).shape)


# --- full (unsharded) tensors: HF <-> Megatron ---------------------------------------------------


def hf_to_megatron(tensors: list[torch.Tensor], rule: TensorRule, spec: ModelSpec) -> torch.Tensor:
    """HF tensors of one rule -> the full Megatron tensor (vocab NOT padded yet)."""
    if rule.kind in ("qkv", "qkv_bias"):
        q, k, v = tensors
        return _merge_qkv(q, k, v, spec)
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
