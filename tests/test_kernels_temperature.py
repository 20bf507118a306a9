"""The kernels' temperature and vocab-padding options against the fp32 oracle on explicitly scaled,
explicitly sliced logits: softmax(logits[..., :valid] / T), values and gradients (the padding columns'
gradient is zero). Runs on every implementation of tests/kernel_support.py (torch, Triton interpreter,
`gpu`: both on CUDA)."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.kernels import linear_logprobs_and_entropy, token_logprobs_and_entropy
from megatron_dapo.kernels.reference import reference_logprobs_and_entropy
from kernel_support import GRAD_RTOL, VALUE_TOL, impl, make_logits, make_targets  # noqa: F401 (fixture)


def _grads(fn, leaf_values: tuple[torch.Tensor, ...], g_lp, g_ent):
    leaves = [v.detach().clone().requires_grad_() for v in leaf_values]
    lp, ent = fn(*[x.view_as(x) for x in leaves])  # non-leaf inputs, as out of a layer
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    return lp.detach(), ent.detach(), *[x.grad for x in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("inplace", [False, True], ids=["new-grad", "inplace"])
def test_temperature_and_padding_match_scaled_sliced_oracle(impl, dtype, temperature, inplace):
    name, device = impl
    logits = make_logits((3, 5, 96), dtype, device)
    valid = 80  # the last 16 columns are padding: never part of the softmax
    targets = make_targets((3, 5), valid, device)
    gen = torch.Generator().manual_seed(9)
    g_lp, g_ent = (torch.randn(3, 5, generator=gen).to(device) for _ in range(2))
    got = _grads(lambda x: token_logprobs_and_entropy(
        x, targets, impl=name, temperature=temperature, vocab_valid=valid, inplace_backward=inplace,
        chunk_bytes=2 * 4 * 96 * 4), (logits,), g_lp, g_ent)
    want = _grads(lambda x: reference_logprobs_and_entropy(x[..., :valid].float() / temperature, targets),
                  (logits,), g_lp, g_ent)
    torch.testing.assert_close(got[0], want[0], **VALUE_TOL)
    torch.testing.assert_close(got[1], want[1], **VALUE_TOL)
    assert got[2].dtype == dtype
    assert not got[2][..., valid:].any()
    torch.testing.assert_close(got[2].float(), want[2].float(), atol=1e-6, rtol=GRAD_RTOL[dtype])


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_linear_temperature_matches_oracle(impl, temperature):
    name, device = impl
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 5, 16, generator=gen).to(device)
    weight = torch.randn(300, 16, generator=gen).to(device)
    targets = make_targets((2, 5), 300, device)
    g_lp, g_ent = (torch.randn(2, 5, generator=gen).to(device) for _ in range(2))
    got = _grads(lambda h, w: linear_logprobs_and_entropy(h, w, targets, impl=name, temperature=temperature,
                                                          chunk_bytes=3 * 300 * 4), (hidden, weight), g_lp, g_ent)
    want = _grads(lambda h, w: reference_logprobs_and_entropy(h @ w.T / temperature, targets),
                  (hidden, weight), g_lp, g_ent)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_bad_temperature_and_vocab_valid_are_refused():
    logits, targets = torch.zeros(2, 8), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_and_entropy(logits, targets, temperature=0.0)
    with pytest.raises(ValueError, match="vocab_valid"):
        token_logprobs_and_entropy(logits, targets, vocab_valid=9)
