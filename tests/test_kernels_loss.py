"""The fused DAPO-loss kernels (loss from logprobs, fused loss from logits, fused-linear loss) against the
plain-torch spec `algo.loss.policy_loss` on oracle logprobs, for every implementation (kernel_support.py)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from kernel_support import VALUE_TOL, impl, make_logits, make_targets  # noqa: F401 - impl is a fixture

from megatron_dapo.algo.loss import AGG_MODES, policy_loss
from megatron_dapo.kernels import fused_linear_policy_loss, fused_policy_loss, loss_from_logprobs
from megatron_dapo.kernels.reference import reference_logprobs_and_entropy


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
    kw: dict[str, Any] = {"eps_low": 0.2, "eps_high": 0.28, "global_num_tokens": 40}
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
    bads: tuple[dict[str, Any], ...] = ({"eps_low": 1.0, "eps_high": 0.28}, {"eps_low": 0.2, "eps_high": -0.1})
    for bad in bads:
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


def test_fused_linear_loss_equals_policy_loss(impl):
    _, targets, old, adv, mask = loss_inputs(impl[1])
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(4, 6, 16, generator=gen).to(impl[1]).requires_grad_()
    weight = torch.randn(300, 16, generator=gen).to(impl[1]).requires_grad_()
    kw: dict[str, Any] = {"eps_low": 0.2, "eps_high": 0.28, "global_num_tokens": 40}
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




# ---------------------------------------------------------------- the other policy-loss variants
VARIANT_KW: dict[str, dict[str, Any]] = {
    "gspo": {"eps_low": 0.1, "eps_high": 0.05},  # its paper's 3e-4 / 4e-4 would clip every sequence here
    "cispo": {"eps_low": None, "eps_high": 1.3},
    "dr_grpo": {"eps_low": None, "eps_high": None, "max_response_len": 8},
}
DUAL_C = {"gspo": 1.02, "dr_grpo": 1.1}  # cispo has no dual clip
VARIANT_CASES = [(k, m) for k in VARIANT_KW for m in ("token-mean", "seq-mean-token-mean")
                 if k != "dr_grpo" or m == "token-mean"]  # dr_grpo's normaliser is its own


@pytest.mark.parametrize("kind, agg_mode", VARIANT_CASES)
@pytest.mark.parametrize("corrected", [False, True], ids=["plain", "dual-clip+is-weights"])
def test_loss_from_logprobs_variants_equal_policy_loss(impl, kind, agg_mode, corrected):
    """Each variant through loss_from_logprobs (the Triton clip kernel for gspo and dr_grpo, torch token terms
    for cispo) against the torch spec: loss, gradient and every metric. Seed 9's sequence ratios (0.82 to
    1.12) put GSPO's rows in each clip: high, low, dual and none."""
    lp, _, old, adv, mask, is_w = oracle_loss_inputs(impl[1], seed=9)
    kw = {**VARIANT_KW[kind], "agg_mode": agg_mode, "global_num_tokens": 40, "global_num_seqs": 5,
          "kind": kind, "is_weights": is_w if corrected else None,
          "clip_ratio_c": DUAL_C.get(kind) if corrected else None}
    got_lp = lp.clone().requires_grad_()
    loss, metrics = loss_from_logprobs(got_lp, None, old, adv, mask, impl=impl[0], **kw)
    loss.backward()
    want_lp = lp.clone().requires_grad_()
    pl_kw = {k: v for k, v in kw.items() if k not in ("eps_low", "eps_high")}
    want, want_metrics = policy_loss(want_lp, old, adv, mask, kw["eps_low"], kw["eps_high"], **pl_kw)
    want.backward()
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_lp.grad, want_lp.grad, atol=1e-7, rtol=1e-5)
    for name, value in vars(want_metrics).items():
        torch.testing.assert_close(getattr(metrics, name), value, atol=1e-6, rtol=1e-6, msg=name)
    assert 0 < metrics.clipfrac_high, "test data must hit the upper clip (CISPO: the cap)"
    assert (0 < metrics.clipfrac_low) == (kind != "cispo"), "test data must hit the lower clip"
    assert (metrics.clipfrac_dual > 0) == (kw["clip_ratio_c"] is not None), "test data must hit the dual clip"


def test_loss_path_names_what_runs():
    from megatron_dapo.kernels.policy_loss import loss_path

    assert loss_path("dapo", "triton") == "fused Triton clip kernel (token ratio)"
    assert loss_path("dr_grpo", "triton") == "fused Triton clip kernel (token ratio)"
    assert loss_path("gspo", "triton") == "fused Triton clip kernel (sequence ratio)"
    assert loss_path("cispo", "triton").startswith("torch token terms")
    assert loss_path("workers.custom_loss:halved_dapo", "triton").startswith("torch token terms")
    assert loss_path("gspo", "torch") == "torch"


@pytest.mark.parametrize("kind", list(VARIANT_KW))
def test_fused_paths_pass_the_kind_through(impl, kind):
    """fused_policy_loss (logits) and fused_linear_policy_loss (hidden + weight) compute the variant."""
    logits, targets, old, adv, mask = loss_inputs(impl[1], seed=3)
    kw = {**VARIANT_KW[kind], "global_num_tokens": 40, "kind": kind}
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(4, 6, 16, generator=gen).to(impl[1]).requires_grad_()
    weight = torch.randn(300, 16, generator=gen).to(impl[1]).requires_grad_()
    leaf = logits.clone().requires_grad_()
    got = fused_policy_loss(leaf, targets, old, adv, mask, impl=impl[0], **kw)[0]
    got_linear = fused_linear_policy_loss(hidden, weight, targets, old, adv, mask, impl=impl[0], **kw)[0]
    got_grads = torch.autograd.grad(got + got_linear, (leaf, hidden, weight))

    ref = logits.clone().requires_grad_()
    pl_kw = {k: v for k, v in kw.items() if k not in ("eps_low", "eps_high")}
    eps = (kw["eps_low"], kw["eps_high"])
    want = policy_loss(reference_logprobs_and_entropy(ref, targets)[0], old, adv, mask, *eps, **pl_kw)[0]
    want_linear = policy_loss(reference_logprobs_and_entropy(hidden @ weight.T, targets)[0], old, adv, mask,
                              *eps, **pl_kw)[0]  # fmt: skip
    want_grads = torch.autograd.grad(want + want_linear, (ref, hidden, weight))
    ref_lp = reference_logprobs_and_entropy(logits, targets)[0]
    dapo = policy_loss(ref_lp, old, adv, mask, global_num_tokens=40)[0]
    assert not torch.allclose(want, dapo), "the variant must differ from DAPO on this batch"
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_linear, want_linear, atol=1e-6, rtol=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
