"""Fused logprob / entropy / DAPO-loss kernels against the plain-torch fp32 oracle: values AND gradients.

Every check runs on each implementation: the chunked torch path, the Triton kernels in the CPU
interpreter (TRITON_INTERPRET=1, small shapes), and (`gpu` tier) both on CUDA with real launches.

Tolerances: all kernels compute in fp32 from the input logits, so values match the fp32 oracle to
fp32 rounding whatever the input dtype. Gradients are returned in the logits' dtype: fp16/bf16
gradients may differ from the oracle's (rounded from fp32) by 1 ulp, and the Triton interpreter
truncates fp32->bf16 stores instead of rounding, so GRAD_RTOL is 1-2 ulp of the dtype.
"""

from __future__ import annotations

import importlib
import math
import subprocess
import sys

import pytest
import torch

from megatron_dapo.algo.loss import AGG_MODES, policy_loss
from megatron_dapo.kernels import (
    fused_linear_policy_loss,
    fused_policy_loss,
    linear_logprobs_and_entropy,
    loss_from_logprobs,
    resolve_impl,
    token_logprobs_and_entropy,
)
from megatron_dapo.kernels.reference import reference_logprobs_and_entropy

HAS_TRITON = importlib.util.find_spec("triton") is not None
VALUE_TOL = {"atol": 2e-5, "rtol": 2e-6}
GRAD_RTOL = {torch.float32: 1e-5, torch.float16: 2**-9, torch.bfloat16: 2**-6}
TRITON_MODULES = ("megatron_dapo.kernels.logprobs_triton", "megatron_dapo.kernels.policy_loss_triton")


def _load_triton(interpret: bool) -> None:
    """(Re)load the Triton modules so that @triton.jit decorates in the wanted mode."""
    from triton.runtime.interpreter import InterpretedFunction

    for name in TRITON_MODULES:
        module = importlib.import_module(name)
        kernel = next(v for k, v in vars(module).items() if k.startswith("_") and k.endswith("_kernel"))
        if isinstance(kernel, InterpretedFunction) != interpret:
            importlib.reload(module)


@pytest.fixture(
    params=[
        pytest.param(("torch", "cpu"), id="torch"),
        pytest.param(
            ("triton", "cpu"),
            id="triton-interp",
            marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton"),
        ),
        pytest.param(("torch", "cuda"), id="torch-cuda", marks=pytest.mark.gpu),
        pytest.param(("triton", "cuda"), id="triton-cuda", marks=pytest.mark.gpu),
    ]
)
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    name, device = request.param
    if name == "triton":
        interpret = device == "cpu"
        monkeypatch.setenv("TRITON_INTERPRET", "1" if interpret else "0")
        _load_triton(interpret)
    return name, device


@pytest.fixture(params=["one-block", "many-blocks"])
def split(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Kwargs that make the vocab walk (Triton) or the token chunks (torch) multi-step."""
    if request.param == "one-block":
        return {}
    if "megatron_dapo.kernels.logprobs_triton" in sys.modules:
        monkeypatch.setattr(sys.modules["megatron_dapo.kernels.logprobs_triton"], "MAX_BLOCK_V", 64)
    return {"chunk_bytes": 3 * 2 * 4 * 300}  # 3 tokens per torch chunk at V=300


def make_logits(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(shape, generator=gen)).to(device=device, dtype=dtype)


def make_targets(shape: tuple[int, ...], vocab: int, device: str, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed)).to(device)


def fwd_bwd(fn, logits: torch.Tensor, targets: torch.Tensor, g_lp, g_ent, view=None, **kw):
    """(logprob, entropy, d(sum g_lp*lp + g_ent*ent)/dlogits) with `view` applied to a leaf copy."""
    leaf = logits.detach().clone().requires_grad_()
    x = leaf if view is None else view(leaf)
    lp, ent = fn(x, targets, **kw)
    loss = (lp * g_lp).sum()
    if g_ent is not None:
        loss = loss + (ent * g_ent).sum()
    loss.backward()
    return lp.detach(), None if ent is None else ent.detach(), leaf.grad


def assert_matches_oracle(impl, logits, targets, *, view=None, entropy_grad=True, **kw) -> None:
    name, device = impl
    g_lp = torch.randn(targets.shape, generator=torch.Generator().manual_seed(2)).to(device)
    g_ent = (
        torch.randn(targets.shape, generator=torch.Generator().manual_seed(3)).to(device)
        if entropy_grad
        else None
    )
    got = fwd_bwd(token_logprobs_and_entropy, logits, targets, g_lp, g_ent, view, impl=name, **kw)
    want = fwd_bwd(reference_logprobs_and_entropy, logits, targets, g_lp, g_ent, view)
    torch.testing.assert_close(got[0], want[0], **VALUE_TOL)
    torch.testing.assert_close(got[1], want[1], **VALUE_TOL)
    assert got[2].dtype == logits.dtype
    torch.testing.assert_close(got[2].float(), want[2].float(), atol=1e-6, rtol=GRAD_RTOL[logits.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_matches_oracle(impl, split, dtype):
    """V=300 is no multiple of any block: the tail of the vocab is masked."""
    logits = make_logits((2, 5, 300), dtype, impl[1])
    assert_matches_oracle(impl, logits, make_targets((2, 5), 300, impl[1]), **split)


@pytest.mark.parametrize(
    "shape, view",
    [
        pytest.param((6, 3, 300), lambda x: x.transpose(0, 1), id="transposed-SBV"),
        pytest.param((3, 6, 600), lambda x: x[:, 1:, ::2], id="vocab-strided"),
        pytest.param((3, 6, 2, 300), lambda x: x.permute(2, 0, 1, 3), id="4d-permuted"),
    ],
)
def test_non_contiguous_inputs(impl, split, shape, view):
    logits = make_logits(shape, torch.float32, impl[1])
    assert not view(logits).is_contiguous()
    targets = make_targets(tuple(view(logits).shape[:-1]), view(logits).shape[-1], impl[1])
    assert_matches_oracle(impl, logits, targets, view=view, **split)


def test_entropy_grad_skipped_equals_zero_entropy_grad(impl):
    logits = make_logits((4, 300), torch.float32, impl[1])
    assert_matches_oracle(impl, logits, make_targets((4,), 300, impl[1]), entropy_grad=False)
    # An explicit all-zero entropy gradient takes the same (skipped) path.
    g_zero = torch.zeros(4, device=impl[1])
    g_lp = torch.ones(4, device=impl[1])
    targets = make_targets((4,), 300, impl[1])
    got = fwd_bwd(token_logprobs_and_entropy, logits, targets, g_lp, g_zero, impl=impl[0])
    want = fwd_bwd(reference_logprobs_and_entropy, logits, targets, g_lp, None)
    torch.testing.assert_close(got[2], want[2], atol=1e-6, rtol=1e-5)


def test_entropy_only_gradient_and_no_entropy(impl):
    logits = make_logits((4, 300), torch.float32, impl[1])
    targets = make_targets((4,), 300, impl[1])
    leaf = logits.clone().requires_grad_()
    _, ent = token_logprobs_and_entropy(leaf, targets, impl=impl[0])
    ent.sum().backward()
    ref = logits.clone().requires_grad_()
    reference_logprobs_and_entropy(ref, targets)[1].sum().backward()
    torch.testing.assert_close(leaf.grad, ref.grad, atol=1e-6, rtol=1e-5)
    lp, none = token_logprobs_and_entropy(logits, targets, impl=impl[0], compute_entropy=False)
    assert none is None
    torch.testing.assert_close(lp, reference_logprobs_and_entropy(logits, targets)[0], **VALUE_TOL)


def test_inplace_backward(impl):
    logits = make_logits((2, 3, 300), torch.float32, impl[1])
    targets = make_targets((2, 3), 300, impl[1])
    leaf = logits.clone().requires_grad_()
    x = leaf * 1.0  # a non-leaf, as logits from the output layer
    lp, ent = token_logprobs_and_entropy(x, targets, impl=impl[0], inplace_backward=True)
    (lp.sum() + ent.sum()).backward()
    ref = logits.clone().requires_grad_()
    sum(reference_logprobs_and_entropy(ref, targets)).sum().backward()
    torch.testing.assert_close(leaf.grad, ref.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(x.detach(), ref.grad)  # the gradient now lives in the logits' storage
    with pytest.raises(ValueError, match="leaf"):
        token_logprobs_and_entropy(
            logits.clone().requires_grad_(), targets, impl=impl[0], inplace_backward=True
        )


def test_inf_logits_and_targets_outside_vocab(impl):
    logits = make_logits((3, 300), torch.float32, impl[1])
    logits[:, 100:] = -float("inf")  # e.g. a vocab mask
    targets = torch.tensor([5, -100, 300], device=impl[1])  # in vocab, ignore-index, one past the end
    lp, ent = token_logprobs_and_entropy(logits, targets, impl=impl[0])
    want_lp, want_ent = reference_logprobs_and_entropy(logits[:, :100], targets.clamp(0, 99))
    torch.testing.assert_close(ent, want_ent, **VALUE_TOL)
    torch.testing.assert_close(lp[0], want_lp[0], **VALUE_TOL)
    assert torch.isfinite(lp).all()  # a meaningless but finite value for ids outside the vocab
    leaf = logits.clone().requires_grad_()
    lp, ent = token_logprobs_and_entropy(leaf, targets, impl=impl[0])
    (lp[0] + ent.sum()).backward()
    assert torch.isfinite(leaf.grad).all() and (leaf.grad[:, 100:] == 0).all()


def loss_inputs(device: str, seed: int = 0):
    logits = make_logits((4, 6, 300), torch.float32, device, seed)
    targets = make_targets((4, 6), 300, device, seed + 1)
    gen = torch.Generator().manual_seed(seed + 2)
    old = reference_logprobs_and_entropy(logits, targets)[0] + 0.4 * torch.randn(4, 6, generator=gen).to(
        device
    )
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.7], device=device)
    mask = (torch.rand(4, 6, generator=gen) > 0.3).float().to(device)
    return logits, targets, old, advantages, mask


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_fused_loss_equals_policy_loss_on_oracle_logprobs(impl, entropy_coef):
    logits, targets, old, adv, mask = loss_inputs(impl[1])
    kw = {"eps_low": 0.2, "eps_high": 0.28, "global_num_tokens": 40}
    leaf = logits.clone().requires_grad_()
    loss, metrics = fused_policy_loss(
        leaf, targets, old, adv, mask, entropy_coef=entropy_coef, impl=impl[0], **kw
    )
    loss.backward()

    ref = logits.clone().requires_grad_()
    lp, ent = reference_logprobs_and_entropy(ref, targets)
    want, want_metrics = policy_loss(lp, old, adv, mask, agg_mode="token-mean", **kw)
    want = want - entropy_coef * (ent * mask).sum() / 40
    want.backward()

    torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(leaf.grad, ref.grad, atol=1e-7, rtol=1e-5)
    for name, value in vars(want_metrics).items():
        torch.testing.assert_close(getattr(metrics, name), value, atol=1e-6, rtol=1e-6, msg=name)
    assert 0 < metrics.clipfrac_high < 1 and 0 < metrics.clipfrac_low < 1, "test data must hit both clips"
    torch.testing.assert_close(metrics.entropy, (ent * mask).sum() / mask.sum(), **VALUE_TOL)


@pytest.mark.parametrize("corrected", [False, True], ids=["plain", "dual-clip+is-weights"])
@pytest.mark.parametrize("pieces", [2, 3])
def test_fused_loss_micro_batches_sum_to_full_batch(impl, corrected, pieces):
    logits, targets, old, adv, mask = loss_inputs(impl[1], seed=5)
    is_w = torch.rand(mask.shape, generator=torch.Generator().manual_seed(9)).to(impl[1]) * 2
    kw = {
        "eps_low": 0.2,
        "eps_high": 0.28,
        "global_num_tokens": mask.sum(),
        "entropy_coef": 0.01,
        "impl": impl[0],
    }
    full = logits.clone().requires_grad_()
    options = {"clip_ratio_c": 1.2, "is_weights": is_w} if corrected else {}
    loss, metrics = fused_policy_loss(full, targets, old, adv, mask, **kw, **options)
    loss.backward()
    assert (metrics.clipfrac_dual > 0) == corrected
    split = logits.clone().requires_grad_()
    total = sum(
        fused_policy_loss(
            split[r], targets[r], old[r], adv[r], mask[r], **kw,
            **{k: v[r] if torch.is_tensor(v) else v for k, v in options.items()},
        )[0]
        for r in ([slice(0, 1), slice(1, 4)] if pieces == 2 else [slice(0, 1), slice(1, 3), slice(3, 4)])
    )  # fmt: skip
    total.backward()
    torch.testing.assert_close(total, loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(split.grad, full.grad, atol=1e-7, rtol=1e-5)


def test_fused_loss_rejects_what_policy_loss_rejects(impl):
    logits, targets, old, adv, mask = loss_inputs(impl[1])
    for bad in ({"eps_low": 1.0, "eps_high": 0.28}, {"eps_low": 0.2, "eps_high": -0.1}):
        with pytest.raises(ValueError):
            policy_loss(old, old, adv, mask, **bad)
        with pytest.raises(ValueError):
            fused_policy_loss(logits, targets, old, adv, mask, global_num_tokens=None, impl=impl[0], **bad)
    with pytest.raises(ValueError):
        fused_policy_loss(
            logits,
            targets,
            old,
            adv[:3],
            mask,
            eps_low=0.2,
            eps_high=0.28,
            global_num_tokens=None,
            impl=impl[0],
        )


def oracle_loss_inputs(device: str, seed: int = 0):
    """(token logprobs, entropies) of the oracle on loss_inputs' logits, plus old, adv, mask, weights."""
    logits, targets, old, adv, mask = loss_inputs(device, seed)
    lp, ent = reference_logprobs_and_entropy(logits, targets)
    is_w = torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed + 7)).to(device) * 2
    is_w[0, 0] = float("nan")  # at a position the mask drops below: must be ignored
    mask[0, 0] = 0.0
    return lp, ent, old, adv, mask, is_w


@pytest.mark.parametrize("agg_mode", AGG_MODES)
@pytest.mark.parametrize("clip_ratio_c", [None, 1.2], ids=["no-dual", "dual"])
@pytest.mark.parametrize("weighted", [False, True], ids=["no-is", "is"])
def test_loss_from_logprobs_equals_policy_loss(impl, agg_mode, clip_ratio_c, weighted):
    lp, _, old, adv, mask, is_w = oracle_loss_inputs(impl[1])
    kw = {"agg_mode": agg_mode, "global_num_tokens": 40, "global_num_seqs": 5, "clip_ratio_c": clip_ratio_c,
          "is_weights": is_w if weighted else None}  # fmt: skip
    got_lp = lp.clone().requires_grad_()
    loss, metrics = loss_from_logprobs(
        got_lp, None, old, adv, mask, eps_low=0.2, eps_high=0.28, impl=impl[0], **kw
    )
    loss.backward()
    want_lp = lp.clone().requires_grad_()
    want, want_metrics = policy_loss(want_lp, old, adv, mask, 0.2, 0.28, **kw)
    want.backward()
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_lp.grad, want_lp.grad, atol=1e-7, rtol=1e-5)
    for name, value in vars(want_metrics).items():
        torch.testing.assert_close(getattr(metrics, name), value, atol=1e-6, rtol=1e-6, msg=name)
    assert metrics.entropy.item() == 0.0
    assert (metrics.clipfrac_dual > 0) == (clip_ratio_c is not None), "test data must hit the dual clip"
    assert 0 < metrics.clipfrac_high and 0 < metrics.clipfrac_low


@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_loss_from_logprobs_entropy_bonus(impl, agg_mode):
    """The bonus is entropy_coef * sum(mask * entropy) / global_num_tokens in every agg_mode."""
    lp, ent, old, adv, mask, _ = oracle_loss_inputs(impl[1])
    kw = {"eps_low": 0.2, "eps_high": 0.28, "agg_mode": agg_mode, "global_num_tokens": 40, "impl": impl[0]}
    base, _ = loss_from_logprobs(lp, None, old, adv, mask, **kw)
    ent_leaf = ent.clone().requires_grad_()
    loss, metrics = loss_from_logprobs(lp, ent_leaf, old, adv, mask, entropy_coef=0.01, **kw)
    loss.backward()
    torch.testing.assert_close(loss, base - 0.01 * (ent * mask).sum() / 40, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent_leaf.grad, -0.01 * mask / 40)
    torch.testing.assert_close(metrics.entropy, (ent * mask).sum() / mask.sum(), **VALUE_TOL)
    monitor = ent.clone().requires_grad_()
    loss, metrics = loss_from_logprobs(lp.clone().requires_grad_(), monitor, old, adv, mask, **kw)
    loss.backward()
    assert monitor.grad is None and loss.item() == pytest.approx(base.item(), abs=1e-6)
    torch.testing.assert_close(metrics.entropy, (ent * mask).sum() / mask.sum(), **VALUE_TOL)
    with pytest.raises(ValueError, match="entropy"):
        loss_from_logprobs(lp, None, old, adv, mask, entropy_coef=0.01, **kw)


def test_kernel_dual_clip_and_clamp_hand_arithmetic(impl):
    """Independent of policy_loss: the brief's A=-1, r=5, c=3 token, and the +-20 log-ratio clamp."""
    device = impl[1]
    lp = torch.tensor([[5.0, 2.0, 5.0, 0.5]], device=device).log().requires_grad_()
    adv = torch.tensor([[-1.0, -1.0, 1.0, -2.0]], device=device)
    ones, zeros = torch.ones(1, 4, device=device), torch.zeros(1, 4, device=device)
    kw = {"eps_low": 0.2, "eps_high": 0.28, "impl": impl[0]}
    loss, m = loss_from_logprobs(lp, None, zeros, adv, ones, clip_ratio_c=3.0, **kw)
    loss.backward()
    # token losses 3 (capped: 5 > c), 2, -1.28 (upper clip), 1.6 (lower clip); only the second has a gradient
    assert loss.item() == pytest.approx((3 + 2 - 1.28 + 1.6) / 4, rel=1e-6)
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.5, 0.0, 0.0]], device=device))
    assert (m.clipfrac_dual.item(), m.clipfrac_high.item(), m.clipfrac_low.item()) == (0.25, 0.25, 0.25)

    lp = torch.tensor([[100.0, 19.5, -100.0, -19.5]], device=device, requires_grad=True)
    adv = torch.tensor([[-1.0, -1.0, 1.0, 1.0]], device=device)
    loss, m = loss_from_logprobs(lp, None, zeros, adv, ones, **kw)
    loss.backward()
    want = (math.exp(20) + math.exp(19.5) - math.exp(-20) - math.exp(-19.5)) / 4
    assert torch.isfinite(loss) and loss.item() == pytest.approx(want, rel=1e-5)
    want_grad = torch.tensor([[0.0, math.exp(19.5) / 4, 0.0, -math.exp(-19.5) / 4]], device=device)
    torch.testing.assert_close(lp.grad, want_grad, rtol=1e-5, atol=0)
    assert m.ratio_max.item() == pytest.approx(math.exp(20), rel=1e-5)


def test_fused_paths_pass_the_options_through(impl):
    logits, targets, old, adv, mask = loss_inputs(impl[1], seed=3)
    _, _, _, _, _, is_w = oracle_loss_inputs(impl[1], seed=3)
    is_w[0, 0] = 1.0
    kw = {"eps_low": 0.2, "eps_high": 0.28, "agg_mode": "seq-mean-token-mean", "global_num_tokens": 40,
          "global_num_seqs": 6, "clip_ratio_c": 1.2, "is_weights": is_w}  # fmt: skip
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(4, 6, 16, generator=gen).to(impl[1]).requires_grad_()
    weight = torch.randn(300, 16, generator=gen).to(impl[1]).requires_grad_()
    leaf = logits.clone().requires_grad_()
    got = fused_policy_loss(leaf, targets, old, adv, mask, impl=impl[0], entropy_coef=0.01, **kw)[0]
    got_linear = fused_linear_policy_loss(hidden, weight, targets, old, adv, mask, impl=impl[0], **kw)[0]
    got_grads = torch.autograd.grad(got + got_linear, (leaf, hidden, weight))

    ref = logits.clone().requires_grad_()
    lp, ent = reference_logprobs_and_entropy(ref, targets)
    pl_kw = {k: v for k, v in kw.items() if k not in ("eps_low", "eps_high")}
    want = policy_loss(lp, old, adv, mask, 0.2, 0.28, **pl_kw)[0] - 0.01 * (ent * mask).sum() / 40
    want_linear = policy_loss(reference_logprobs_and_entropy(hidden @ weight.T, targets)[0], old, adv, mask,
                              0.2, 0.28, **pl_kw)[0]  # fmt: skip
    want_grads = torch.autograd.grad(want + want_linear, (ref, hidden, weight))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_linear, want_linear, atol=1e-6, rtol=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_matches_oracle_on_materialised_logits(impl, dtype):
    """hidden @ weight^T in token chunks (3 rows each) + kernels == the oracle on the full logits.

    bf16: the chunked and the full matmul may round logits differently, hence looser tolerances.
    """
    device = impl[1]
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 5, 16, generator=gen).to(device=device, dtype=dtype)
    weight = torch.randn(300, 16, generator=gen).to(device=device, dtype=dtype)
    targets = make_targets((2, 5), 300, device)
    g_lp, g_ent = (torch.randn(2, 5, generator=gen).to(device) for _ in range(2))

    def run(fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = fn(h, w)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        return lp.detach(), ent.detach(), h.grad, w.grad

    got = run(lambda h, w: linear_logprobs_and_entropy(h, w, targets, impl=impl[0], chunk_bytes=3 * 300 * 4))
    want = run(lambda h, w: reference_logprobs_and_entropy(h @ w.T, targets))
    tol = VALUE_TOL if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), **tol)


def test_fused_linear_loss_equals_policy_loss(impl):
    _, targets, old, adv, mask = loss_inputs(impl[1])
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(4, 6, 16, generator=gen).to(impl[1]).requires_grad_()
    weight = torch.randn(300, 16, generator=gen).to(impl[1]).requires_grad_()
    kw = {"eps_low": 0.2, "eps_high": 0.28, "global_num_tokens": 40}
    loss, metrics = fused_linear_policy_loss(
        hidden, weight, targets, old, adv, mask, entropy_coef=0.01, impl=impl[0], **kw
    )
    grads = torch.autograd.grad(loss, (hidden, weight))
    lp, ent = reference_logprobs_and_entropy(hidden @ weight.T, targets)
    want, want_metrics = policy_loss(lp, old, adv, mask, agg_mode="token-mean", **kw)
    want = want - 0.01 * (ent * mask).sum() / 40
    want_grads = torch.autograd.grad(want, (hidden, weight))
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-5)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(metrics.clipfrac_low, want_metrics.clipfrac_low)


def test_resolve_impl(monkeypatch):
    monkeypatch.delenv("MEGATRON_DAPO_KERNEL_IMPL", raising=False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_impl("auto", cpu) == "torch"
    assert resolve_impl("auto", cuda) == ("triton" if HAS_TRITON else "torch")
    assert resolve_impl("torch", cuda) == "torch"
    monkeypatch.setenv("MEGATRON_DAPO_KERNEL_IMPL", "torch")
    assert resolve_impl("auto", cuda) == "torch"
    monkeypatch.setenv("MEGATRON_DAPO_KERNEL_IMPL", "cuda")
    with pytest.raises(ValueError, match="MEGATRON_DAPO_KERNEL_IMPL"):
        resolve_impl("auto", cpu)
    with pytest.raises(ValueError, match="unknown"):
        resolve_impl("tilelang", cpu)
    if HAS_TRITON:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            resolve_impl("triton", cpu)


def test_shape_errors():
    with pytest.raises(ValueError, match="targets"):
        token_logprobs_and_entropy(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="floating"):
        token_logprobs_and_entropy(torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    lp, ent = token_logprobs_and_entropy(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long))
    assert lp.shape == ent.shape == (0,)


@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
@pytest.mark.parametrize("arch", [80, 90])
def test_triton_kernels_compile_for_cuda(python_env, repo_root, tmp_path, arch):
    """The interpreter accepts code that real compilation rejects: compile every variant to a cubin.

    In a fresh process without TRITON_INTERPRET: this one imported triton in interpreter mode, which
    triton cannot switch off in-process (triton 3.9's gluon asserts; reloading kernels half-works)."""
    env = {k: v for k, v in python_env.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile now, not a cached cubin
    worker = repo_root / "tests" / "workers" / "triton_aot_compile.py"
    proc = subprocess.run(
        [sys.executable, str(worker), str(arch)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"AOT compile for sm_{arch} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    compiled = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("ok ")]
    assert len(compiled) == 7, proc.stdout  # 2 stats + 4 grad + 1 clip-loss variants
    assert {name.split("[")[0] for name in compiled} == {"_stats_kernel", "_grad_kernel", "_clip_loss_kernel"}


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", *sys.argv[1:]]))
