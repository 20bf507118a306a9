"""The embedded engine's decoders: the same loop serves a fast Llama-family path and a generic one.

- `LlamaDecoder` (Llama / Qwen2 / Qwen3 families): runs the model's own modules and weights with a
  preallocated KV cache and precomputed rotary tables, without the generic forward's per-step mask
  building and bookkeeping (about half of `model.generate`'s step time on a small model on CPU).
- `HFDecoder` (any other causal LM): the model's own forward with a transformers DynamicCache.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from megatron_dapo.rollout.embedded.routes import RouteTape, moe_routers

_LLAMA_LIKE = ("llama", "qwen2", "qwen3")


class Decoder(Protocol):
    def prefill(self, ids: Tensor, mask: Tensor) -> Tensor:
        """Left-padded prompts [B, S] and their bool mask -> next-token logits [B, V]."""

    def select(self, rows: Tensor) -> None:
        """Keep (or repeat) batch rows: the new batch is old[rows]."""

    def step(self, tokens: Tensor) -> Tensor:
        """Append one token per row [B] -> next-token logits [B, V]."""

    def routes(self, row: int) -> Tensor | None:
        """A mixture-of-experts model's routes of batch row `row` at every position it read, when the decoder was
        built with record_routes (else None, as for a dense model)."""


def _positions(mask: Tensor) -> Tensor:
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


class HFDecoder:
    """Generic path: the model's forward with explicit position ids and a transformers cache."""

    def __init__(self, model: PreTrainedModel, max_len: int, record_routes: bool = False) -> None:
        self.model, self.max_len = model, max_len
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self._routers = moe_routers(model) if record_routes else []
        self.tape: RouteTape | None = None
        """With `record_routes`, a mixture-of-experts model's routes of every row and position (routes.py)."""

    def _forward(self, ids: Tensor, mask: Tensor, pos: Tensor, start: int) -> Tensor:
        kwargs = {self.cache_kw: self.cache}
        rows, width = ids.shape
        with self.tape.reading(rows, width, start) if self.tape is not None else nullcontext():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                             logits_to_keep=1, **kwargs)
        return out.logits[:, -1]

    def prefill(self, ids: Tensor, mask: Tensor) -> Tensor:
        b, s = ids.shape
        self.cache = DynamicCache(config=self.model.config)
        self.mask = torch.zeros(b, self.max_len, dtype=torch.long, device=ids.device)
        self.mask[:, :s] = mask
        self.tape = RouteTape(self._routers, b, self.max_len) if self._routers else None
        pos = _positions(mask)
        self.length, self.pos = s, pos[:, -1] + 1
        return self._forward(ids, self.mask[:, :s], pos, 0)

    def select(self, rows: Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.mask, self.pos = self.mask[rows], self.pos[rows]
        if self.tape is not None:
            self.tape.select(rows)

    def step(self, tokens: Tensor) -> Tensor:
        self.mask[:, self.length] = 1
        logits = self._forward(tokens[:, None], self.mask[:, : self.length + 1], self.pos[:, None], self.length)
        self.length += 1
        self.pos = self.pos + 1
        return logits

    def routes(self, row: int) -> Tensor | None:
        """Row `row`'s routes at every position it read, in order (None for a dense model or unrecorded)."""
        return None if self.tape is None else self.tape.row(row, self.mask[row])


def _rms_norm(norm: torch.nn.Module, x: Tensor) -> Tensor:
    """transformers' RMSNorm (normalise in fp32, cast back, then scale), as one fused op."""
    y = F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon)
    return norm.weight * y.to(x.dtype)


def _rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) * sin = roll(x) * [-sin_1, sin_2]."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def llama_fast_path_ok(model: PreTrainedModel) -> bool:
    """Whether `LlamaDecoder` reproduces this model's forward (dense, full attention, static RoPE)."""
    cfg = model.config
    rope_cfg = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope = rope_cfg.get("rope_type", rope_cfg.get("type", "default"))
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"]
    return (
        cfg.model_type in _LLAMA_LIKE
        and rope not in ("dynamic", "longrope")
        and all(t == "full_attention" for t in layer_types)
        and hasattr(getattr(model, "model", None), "rotary_emb")
    )


class LlamaDecoder:
    """Llama-family decode over the model's own weights with a static KV cache [B, Hkv, L, D]."""

    def __init__(self, model: PreTrainedModel, max_len: int, record_routes: bool = False) -> None:
        """`record_routes` is taken for the Decoder protocol: a dense model routes nothing."""
        cfg, self.model, self.inner = model.config, model, model.model
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self._rope_tables(max_len)

    def routes(self, row: int) -> Tensor | None:
        return None  # dense models only (llama_fast_path_ok)

    def _rope_tables(self, max_len: int) -> None:
        """cos / signed sin [max_len, D] for positions 0 .. max_len - 1."""
        self.max_len = max_len
        dtype, device = self.inner.embed_tokens.weight.dtype, self.inner.embed_tokens.weight.device
        anchor = torch.empty(0, dtype=dtype, device=device)
        cos, sin = self.inner.rotary_emb(anchor, torch.arange(max_len, device=device)[None])
        half = sin.shape[-1] // 2
        self.cos, self.sin = cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)

    def prefill(self, ids: Tensor, mask: Tensor) -> Tensor:
        b, s = ids.shape
        shape = (b, self.n_kv, self.max_len, self.head_dim)
        dtype = self.cos.dtype
        self.keys = [ids.new_zeros(shape, dtype=dtype) for _ in self.inner.layers]
        self.values = [ids.new_zeros(shape, dtype=dtype) for _ in self.inner.layers]
        self.key_bias = ids.new_full((b, 1, 1, self.max_len), float("-inf"), dtype=dtype)
        self.key_bias[:, 0, 0, :s].masked_fill_(mask, 0.0)
        causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
        # A padding query attends to itself only: an all-masked row would give NaN and poison the KV.
        attn = (causal & mask[:, None, :]) | torch.eye(s, dtype=torch.bool, device=ids.device)
        pos = _positions(mask)
        self.length, self.pos = 0, pos[:, -1] + 1
        return self._forward(ids, pos, attn[:, None])

    def select(self, rows: Tensor) -> None:
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        self.key_bias, self.pos = self.key_bias.index_select(0, rows), self.pos.index_select(0, rows)

    def step(self, tokens: Tensor) -> Tensor:
        self.key_bias[..., self.length] = 0.0
        logits = self._forward(tokens[:, None], self.pos[:, None], self.key_bias[..., : self.length + 1])
        self.pos = self.pos + 1
        return logits

    def _forward(self, ids: Tensor, pos: Tensor, attn_mask: Tensor | None,
                 last: Tensor | None = None) -> Tensor:
        """Logits after the token at index `last` of each row (default: the last position)."""
        h = self.inner.embed_tokens(ids)
        cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)
        for i, layer in enumerate(self.inner.layers):
            x = _rms_norm(layer.input_layernorm, h)
            h = h + self._attention(layer.self_attn, x, cos, sin, i, attn_mask)
            mlp, x = layer.mlp, _rms_norm(layer.post_attention_layernorm, h)
            gate = mlp.act_fn(F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias))
            h = h + F.linear(gate * F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias),
                             mlp.down_proj.weight, mlp.down_proj.bias)
        self.length += ids.shape[1]
        h = h[:, -1] if last is None else h[torch.arange(h.shape[0], device=h.device), last]
        return self.model.lm_head(_rms_norm(self.inner.norm, h))

    def _attention(self, attn: torch.nn.Module, x: Tensor, cos: Tensor, sin: Tensor, layer: int,
                   mask: Tensor | None) -> Tensor:
        """`mask` None: plain causal attention over the new positions only (a right-padded prefill)."""
        b, s, _ = x.shape
        q = F.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(b, s, self.n_heads, self.head_dim)
        k = F.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(b, s, self.n_kv, self.head_dim)
        v = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(b, s, self.n_kv, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE
            q, k = _rms_norm(attn.q_norm, q), _rms_norm(attn.k_norm, k)
        q, k = _rope(q.transpose(1, 2), cos, sin), _rope(k.transpose(1, 2), cos, sin)
        keys, values = self._store(layer, k, v.transpose(1, 2))
        if mask is not None and s == 1:  # decode: grouped-query attention as two small matmuls (faster
            # than SDPA on CPU)
            qg = q.reshape(b, self.n_kv, self.n_heads // self.n_kv, self.head_dim)
            scores = (qg @ keys.transpose(-1, -2)) * attn.scaling + mask
            out = (scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ values).reshape(b, 1, -1)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                                 scale=attn.scaling, enable_gqa=self.n_kv != self.n_heads)
            out = out.transpose(1, 2).reshape(b, s, -1)
        return F.linear(out, attn.o_proj.weight, attn.o_proj.bias)

    def _store(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write the new keys / values [B, Hkv, S, D] into the cache; return every key / value so far."""
        end = self.length + k.shape[2]
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]
