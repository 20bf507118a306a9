"""model.local_attention=sdpa (actor/attention.py): the same function as the unfused attention written out in
plain torch (grouped-query heads repeated, scores, masked float32 softmax, weighted values), outputs and
gradients, for a causal sequence, for a packed shared-prefix sequence with its block mask and padding, and
for rows packed in Megatron's thd format; and the layer spec that puts it in place of Megatron's DotProductAttention."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from megatron_dapo.actor.prefix import block_mask

HEADS, GROUPS, DIM = 9, 3, 64  # SmolLM2-135M's attention


def reference(q, k, v, mask):
    """Plain torch: q [s, b, h, d], k / v [s, b, g, d], mask [b, 1, s, s] True = masked (None = causal)."""
    s, b, h, d = q.shape
    k, v = (t.repeat_interleave(h // t.shape[2], dim=2) for t in (k, v))
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(d)
    if mask is None:
        mask = ~torch.ones(s, s, dtype=torch.bool).tril()
    probs = torch.softmax(scores.float().masked_fill(mask, float("-inf")), dim=-1).to(q.dtype)
    return torch.einsum("bhqk,kbhd->qbhd", probs, v).reshape(s, b, h * d)


def core_attention():
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_dapo.actor.attention import SDPAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                            num_query_groups=GROUPS, kv_channels=DIM, attention_dropout=0.0)
    return SDPAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


UNITS = torch.tensor([0] * 15 + [1] * 12 + [-1] * 3)
SEGMENTS = torch.tensor([0] * 5 + [1] * 4 + [2] * 6 + [0] * 7 + [1] * 5 + [0] * 3)


def packed_mask(batch: int) -> torch.Tensor:
    """Two units per sequence: a 5-token prefix and segments of 4 and 6, then a 7-token prefix and one segment
    of 5, then 3 padding positions (padding sees padding)."""
    return block_mask(UNITS, SEGMENTS)[None, None].expand(batch, 1, -1, -1)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_sdpa_equals_the_unfused_attention(masked, dtype, tol):
    torch.manual_seed(0)
    s, b = 30, 2
    mask = packed_mask(b) if masked else None
    q = torch.randn(s, b, HEADS, DIM, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(s, b, GROUPS, DIM, dtype=dtype, requires_grad=True) for _ in range(2))
    grad = torch.randn(s, b, HEADS * DIM, dtype=dtype)
    results = []
    for f in (lambda *a: core_attention()(*a), reference):
        out = f(q, k, v, mask)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
        results.append((out, dq, dk, dv))
    for got, want in zip(*results):
        assert got.shape == want.shape
        assert (got.float() - want.float()).abs().max() <= tol * max(1.0, want.float().abs().max())


def test_the_blocks_compute_the_block_masks_attention():
    """Inside attention_blocks, the packed batch's attention is computed block by block (a prefix; a segment
    with its prefix): outputs and gradients equal the dense masked attention at every real position (padding
    positions give 0 there, and nothing reads them); a second sequence lays out its units differently."""
    from megatron_dapo.actor.attention import attention_blocks as computed_as
    from megatron_dapo.actor.prefix import blocks_of

    torch.manual_seed(1)
    units = torch.stack([UNITS, torch.tensor([0] * 9 + [1] * 18 + [-1] * 3)])
    segments = torch.stack([SEGMENTS, torch.tensor([0] * 2 + [1] * 7 + [1] * 3 + [2] * 3 + [3] * 12 + [0] * 3)])
    mask = torch.stack([block_mask(u, g) for u, g in zip(units, segments)]).unsqueeze(1)
    s, b = units.shape[1], 2
    real = (units >= 0).t()[..., None]  # [s, b, 1]
    q = torch.randn(s, b, HEADS, DIM, requires_grad=True)
    k, v = (torch.randn(s, b, GROUPS, DIM, requires_grad=True) for _ in range(2))
    grad = torch.randn(s, b, HEADS * DIM) * real
    blocks = blocks_of(units, segments)
    assert len(blocks) == 2 and int(sum(blk.valid.sum() for blk in blocks)) == int(real.sum())
    results = []
    for inside in (computed_as(blocks, (b, s)), computed_as(None, (b, s))):
        with inside:
            out = core_attention()(q, k, v, mask)
        results.append((out * real, *torch.autograd.grad(out, (q, k, v), grad)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert torch.equal(results[1][0], core_attention()(q, k, v, mask) * real)  # outside: the dense mask again


def test_thd_packed_sequences_equal_each_sequence_on_its_own():
    """Megatron's thd format (rows packed one after the other, actor/batching.py's pack_sequences): each
    sequence's outputs and q/k/v gradients are those of the plain causal attention over it alone."""
    from megatron.core.packed_seq_params import PackedSeqParams

    torch.manual_seed(2)
    lengths = [7, 1, 12, 4]
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    t = int(cu[-1])
    q = torch.randn(t, HEADS, DIM, requires_grad=True)
    k, v = (torch.randn(t, GROUPS, DIM, requires_grad=True) for _ in range(2))
    grad = torch.randn(t, 1, HEADS * DIM)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                             max_seqlen_kv=max(lengths))
    out = core_attention()(q, k, v, None, packed_seq_params=params)
    assert out.shape == (t, 1, HEADS * DIM)
    got = (out, *torch.autograd.grad(out, (q, k, v), grad))
    pieces = [reference(q[a:b].unsqueeze(1), k[a:b].unsqueeze(1), v[a:b].unsqueeze(1), None)
              for a, b in itertools.pairwise(cu)]
    ref = torch.cat(pieces)
    want = (ref, *torch.autograd.grad(ref, (q, k, v), grad))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="thd"):
        core_attention()(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))


def test_the_local_spec_uses_it_unless_asked_for_megatrons():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_dapo.actor.attention import SDPAttention
    from megatron_dapo.actor.model import ModelSpec, layer_spec
    from megatron_dapo.config import ModelConfig

    spec = ModelSpec(family="llama", num_layers=2, hidden_size=HEADS * DIM, ffn_hidden_size=1536, num_heads=HEADS,
                     num_kv_heads=GROUPS, head_dim=DIM, vocab_size=256, max_position_embeddings=512,
                     rope_theta=1e4, norm_eps=1e-5, qkv_bias=False, tied_embeddings=True)

    def core(**kw):
        return layer_spec(ModelConfig(transformer_impl="local", **kw), spec).submodules.self_attention.submodules \
            .core_attention

    assert core() is SDPAttention and core(local_attention="megatron") is DotProductAttention

