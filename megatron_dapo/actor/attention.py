"""The local layer spec's core attention (`model.local_attention=sdpa`): torch's scaled_dot_product_attention
in place of Megatron's DotProductAttention.

Megatron's local core attention is unfused: it repeats the keys and values of each query group, writes the
[b, heads, s, s] scores, masks and softmaxes them in float32 and multiplies by the values, and its backward
walks the same tensors back. On a packed shared-prefix sequence (actor/prefix.py: a few hundred positions,
most pairs masked) that took as long as the layer's linear maps on a CPU. SDPA computes the same function in
one kernel (flash attention on CPU and GPU, grouped-query heads without the repeat), so only its rounding
differs (tests/test_attention.py). Transformer Engine's spec keeps TE's own attention."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_dapo.actor.prefix import AttentionBlocks


class SDPAttention(MegatronModule):
    """DotProductAttention's interface and function: query [sq, b, heads, d], key / value [sk, b, groups, d]
    (this TP rank's heads), `attention_mask` [b or 1, 1, sq, sk] bool with True = masked (Megatron's
    convention), or None for a causal mask; returns the context [sq, b, heads * d]."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1 or config.softmax_type != "vanilla" or config.window_size:
            raise ValueError("model.local_attention=sdpa: no context parallelism, sliding window or softmax "
                             "offset (use model.local_attention=megatron)")
        self.attn_mask_type = attn_mask_type
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        # apply_query_key_layer_scaling divides Megatron's scores by the layer number and its softmax multiplies
        # them back (fp16 range only): the function is the same
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params=None) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("model.local_attention=sdpa takes no attention bias")
        if packed_seq_params is not None:
            return self._thd(query, key, value, packed_seq_params)
        blocks = _BLOCKS.get()
        if blocks and blocks[1] == (query.shape[1], query.shape[0]):
            return self._blockwise(query, key, value, blocks[0])
        mask_type = attn_mask_type or self.attn_mask_type
        causal = attention_mask is None and mask_type == AttnMaskType.causal
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads or groups, s, d]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if attention_mask is None else ~attention_mask, is_causal=causal,
            dropout_p=self.dropout if self.training else 0.0, scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1])
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    def _thd(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params) -> torch.Tensor:
        """Megatron's thd format: query [t, heads, d], key / value [t, groups, d] hold the sequences of
        `params.cu_seqlens_q` one after the other, each causal on its own. Computed as one right-padded
        causal batch [sequences, heads, longest, d]: a real query sees no padding key, padding queries are
        dropped. Returns [t, 1, heads * d]."""
        if params.qkv_format != "thd" or not torch.equal(params.cu_seqlens_q, params.cu_seqlens_kv):
            raise ValueError("model.local_attention=sdpa: packed sequences in thd format, the same for q and kv")
        cu = params.cu_seqlens_q.long()
        t, heads, d = query.shape
        offsets = torch.arange(params.max_seqlen_q, device=query.device)
        idx = (cu[:-1, None] + offsets).clamp(max=t - 1)  # [sequences, longest]
        valid = offsets < (cu[1:] - cu[:-1])[:, None]
        q, k, v = (x[idx].transpose(1, 2) for x in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
                                             scale=self.softmax_scale, enable_gqa=heads != key.shape[1])
        flat = query.new_zeros(t, heads, d).index_put((idx[valid],), out.transpose(1, 2)[valid])
        return flat.view(t, 1, heads * d)

    def _blockwise(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   blocks: list[AttentionBlocks]) -> torch.Tensor:
        """The block mask's attention as its blocks (actor/prefix.py), each set of blocks one SDPA call:
        only the pairs a block sees are computed; positions in no block (padding) give 0."""
        sq, b, heads, d = query.shape
        q, k, v = (t.transpose(0, 1).reshape(b * sq, t.shape[2], d) for t in (query, key, value))
        out = q.new_zeros(b * sq, heads, d)
        for blk in blocks:  # on the activations' device (attention_blocks)
            qb, kb, vb = (t[idx].transpose(1, 2) for t, idx in ((q, blk.queries), (k, blk.keys), (v, blk.keys)))
            ob = F.scaled_dot_product_attention(
                qb, kb, vb, attn_mask=blk.visible, dropout_p=self.dropout if self.training else 0.0,
                scale=self.softmax_scale, enable_gqa=heads != k.shape[1])
            out = out.index_put((blk.queries[blk.valid],), ob.transpose(1, 2)[blk.valid])
        return out.view(b, sq, heads * d).transpose(0, 1).contiguous()


_BLOCKS: ContextVar[tuple[list[AttentionBlocks], tuple[int, int]] | None] = ContextVar("blocks", default=None)


@contextmanager
def attention_blocks(blocks: list[AttentionBlocks] | None, shape: tuple[int, int],
                     device: torch.device | str = "cpu") -> Iterator[None]:
    """Inside, the SDPA core attention computes a masked [P, L] (`shape`) batch as `blocks` (None: the mask),
    moved to `device` once for all the layers."""
    token = _BLOCKS.set(([blk.to(device) for blk in blocks], shape) if blocks else None)
    try:
        yield
    finally:
        _BLOCKS.reset(token)
