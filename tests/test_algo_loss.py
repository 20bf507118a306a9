"""The DAPO policy loss against hand arithmetic from the paper (and verl's dual-clip), and its split
invariance with and without importance weights."""

import math
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from spawn import run_ranks
from support import global_kwargs, random_batch

from megatron_dapo.algo.loss import LOG_RATIO_LIMIT, policy_loss

F64 = torch.float64


def one_token_grad(old_p: float, new_p: float, eps: float, adv: float = 1.0) -> float:
    logprobs = torch.tensor([[new_p]], dtype=F64).log().requires_grad_()
    old = torch.tensor([[old_p]], dtype=F64).log()
    loss, _ = policy_loss(logprobs, old, torch.tensor([adv], dtype=F64), torch.ones(1, 1), eps, eps)
    loss.backward()
    return logprobs.grad.item()


@pytest.mark.parametrize(
    "old_p, eps, ceiling",
    [(0.01, 0.2, 0.012), (0.9, 0.2, 1.08), (0.01, 0.28, 0.0128), (0.9, 0.28, 1.152)],
)
def test_clip_ceiling(old_p, eps, ceiling):
    assert old_p * (1 + eps) == pytest.approx(ceiling)
    below = min(ceiling * 0.99, 1.0)
    # d(-r A)/d logp = -r A with r = new / old
    assert one_token_grad(old_p, below, eps) == pytest.approx(-below / old_p)
    if ceiling < 1.0:
        assert one_token_grad(old_p, ceiling * 1.01, eps) == 0.0
    # a negative advantage is not clipped above: the token is still pushed down
    assert one_token_grad(old_p, min(ceiling * 1.01, 1.0), eps, adv=-1.0) != 0.0


def test_clip_higher_unlocks_low_probability_tokens():
    # old 0.01 -> new 0.0125: beyond the symmetric ceiling 0.012, inside the clip-higher one 0.0128
    assert one_token_grad(0.01, 0.0125, 0.2) == 0.0
    assert one_token_grad(0.01, 0.0125, 0.28) == pytest.approx(-1.25)


def test_lower_clip_and_metrics():
    old = torch.zeros(1, 4, dtype=F64)
    ratios = torch.tensor([[1.5, 0.5, 1.0, 1.4]], dtype=F64)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=F64)
    logprobs = ratios.log().requires_grad_()
    loss, m = policy_loss(logprobs, old, adv, torch.ones(1, 4))
    loss.backward()
    # objectives: min(1.5, 1.28) = 1.28 (clipped); min(-0.5, -0.8) = -0.8 (clipped); 1.0;
    # min(-1.4, -1.28) = -1.4 (a negative advantage is not clipped above)
    assert loss.item() == pytest.approx(-(1.28 - 0.8 + 1.0 - 1.4) / 4)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, -0.25, 1.4 / 4]], dtype=F64))
    assert m.clipfrac_high.item() == pytest.approx(0.25)
    assert m.clipfrac_low.item() == pytest.approx(0.25)
    assert m.ratio_mean.item() == pytest.approx(1.1)
    assert m.ratio_max.item() == pytest.approx(1.5)
    k3 = sum(r - 1 - torch.tensor(r).log().item() for r in (1.5, 0.5, 1.0, 1.4)) / 4
    assert m.approx_kl.item() == pytest.approx(k3)
    assert m.num_tokens.item() == 4
    assert not m.approx_kl.requires_grad


def test_padding_garbage_is_ignored():
    logprobs = torch.tensor([[-1.0, -torch.inf], [-2.0, float("nan")]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.0, 5.0], [-2.0, float("nan")]], dtype=F64)
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    loss, m = policy_loss(logprobs, old, torch.tensor([1.0, -1.0], dtype=F64), mask)
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(logprobs.grad).all()
    assert m.num_tokens.item() == 2 and m.ratio_max.item() == 1.0


def test_sample_level_vs_token_level_weight():
    lengths = [3200, 180] + [400] * 14
    T = max(lengths)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).to(F64)
    grads = {}
    for mode in ("seq-mean-token-mean", "token-mean"):
        logprobs = torch.zeros(len(lengths), T, dtype=F64, requires_grad=True)
        loss, _ = policy_loss(logprobs, torch.zeros_like(logprobs), torch.ones(len(lengths), dtype=F64), mask, agg_mode=mode)
        loss.backward()
        grads[mode] = logprobs.grad
    g = grads["seq-mean-token-mean"]
    assert (g[0, 0] / g[1, 0]).item() == pytest.approx(180 / 3200)
    assert g[0, 0].item() == pytest.approx(-1 / (16 * 3200))
    g = grads["token-mean"]
    assert (g[0, 0] / g[1, 0]).item() == pytest.approx(1.0)
    assert g[0, 0].item() == pytest.approx(-1 / sum(lengths))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batch_split_invariance(mode):
    base, old, adv, mask = random_batch(0)
    full_lp = base.clone().requires_grad_()
    full_loss, m = policy_loss(full_lp, old, adv, mask, agg_mode=mode)
    full_loss.backward()
    assert m.clipfrac_high > 0 and m.clipfrac_low > 0

    split_lp = base.clone().requires_grad_()
    perm = torch.randperm(len(base), generator=torch.Generator().manual_seed(1))
    total = torch.zeros((), dtype=F64)
    for idx in torch.split(perm, [1, 4, 2, 4]):
        loss, _ = policy_loss(split_lp[idx], old[idx], adv[idx], mask[idx], agg_mode=mode, **global_kwargs(mode, mask))
        loss.backward()
        total += loss.detach()
    torch.testing.assert_close(total, full_loss.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(split_lp.grad, full_lp.grad, atol=1e-6, rtol=0)


def test_token_level_advantages_match_broadcast():
    base, old, adv, mask = random_batch(2)
    a, _ = policy_loss(base, old, adv, mask)
    b, _ = policy_loss(base, old, adv[:, None].expand_as(base).clone(), mask)
    torch.testing.assert_close(a, b)


def test_validation():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-mean, seq-mean-token-sum"):
        policy_loss(x, x, torch.zeros(2), x, agg_mode="seq-mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        policy_loss(x, x, torch.zeros(2), x, eps_low=1.0)
    with pytest.raises(ValueError):
        policy_loss(x, x, torch.zeros(2), x, eps_high=-0.1)
    with pytest.raises(ValueError):
        policy_loss(x, x, torch.zeros(3), x)


GSPO = {"eps_low": 0.03, "eps_high": 0.04}  # GSPO's own 3e-4 would clip every sequence of this batch
DP_CASES: list[tuple[str, dict[str, Any]]] = [
    ("dapo", {}), ("dapo", {"clip_ratio_c": 1.2, "weighted": True}),
    ("gspo", GSPO), ("gspo", {**GSPO, "clip_ratio_c": 1.05, "weighted": True}),
    ("gspo", {**GSPO, "agg_mode": "seq-mean-token-mean"}),
    ("cispo", {"eps_high": 1.2}), ("cispo", {"eps_high": 1.2, "weighted": True}),
    ("dr_grpo", {"max_response_len": 40}),
    ("dr_grpo", {"max_response_len": 40, "clip_ratio_c": 1.2, "weighted": True}),
]
"""Every variant, plain and with importance weights (+ dual-clip where it applies)."""


def _dp_worker(rank: int, world_size: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        # A shared "model" theta makes logprobs depend on parameters every rank holds, as in DP.
        base, old, adv, mask = random_batch(3, B=10)
        is_w = torch.rand(base.shape, generator=torch.Generator().manual_seed(8), dtype=F64) * 2
        for kind, options in DP_CASES:
            kw = {k: v for k, v in options.items() if k != "weighted"}
            kw.update(kind=kind, is_weights=is_w if options.get("weighted") else None)
            theta = torch.zeros(base.shape[1], dtype=F64, requires_grad=True)
            ref_loss, _ = policy_loss(base + theta, old, adv, mask, **kw)
            (ref_grad,) = torch.autograd.grad(ref_loss, theta)

            rows = slice(rank * 5, (rank + 1) * 5)
            kw = {k: v[rows] if torch.is_tensor(v) else v for k, v in kw.items()}
            counts = torch.stack([mask[rows].sum(), (mask[rows].sum(-1) > 0).sum()]).to(F64)
            dist.all_reduce(counts)
            loss, _ = policy_loss(base[rows] + theta, old[rows], adv[rows], mask[rows],
                                  global_num_tokens=counts[0], global_num_seqs=counts[1], **kw)
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            dist.all_reduce(theta.grad)
            torch.testing.assert_close(total, ref_loss.detach(), atol=1e-6, rtol=0)
            torch.testing.assert_close(theta.grad, ref_grad, atol=1e-6, rtol=0)
    finally:
        dist.destroy_process_group()


def test_two_rank_gloo_data_parallel_matches_full_batch():
    """Each rank's share, normalised by the counts all-reduced over the 2 ranks, sums (all-reduce) to the
    full batch's loss and gradient of a parameter both ranks hold, for every policy-loss variant."""
    run_ranks(_dp_worker)


def test_empty_batch_gives_zero_loss_and_metrics():
    empty = torch.zeros(0, 3)
    loss, m = policy_loss(empty, empty, torch.zeros(0), empty)
    assert loss.item() == 0.0 and m.num_tokens.item() == 0 and m.ratio_max.item() == 0


# ---------------------------------------------------------------- dual-clip, log-ratio clamp, IS weights
def four_tokens(clip_ratio_c=None, is_weights=None, dtype=F64):
    """Ratios 5, 2, 5, 0.5 with advantages -1, -1, +1, -2 (eps 0.2 / 0.28), one row."""
    logprobs = torch.tensor([[5.0, 2.0, 5.0, 0.5]], dtype=dtype).log().requires_grad_()
    adv = torch.tensor([[-1.0, -1.0, 1.0, -2.0]], dtype=dtype)
    loss, m = policy_loss(logprobs, torch.zeros_like(logprobs), adv, torch.ones(1, 4),
                          clip_ratio_c=clip_ratio_c, is_weights=is_weights)
    loss.backward()
    return loss, logprobs.grad, m


def test_dual_clip_hand_arithmetic():
    # token losses -min(rA, clip(r)A), then capped at -cA = c|A| for A < 0 (c = 3):
    #   A=-1, r=5:   min(-5, -1.28) = -5 -> loss 5, capped at 3, zero gradient (dual clip)
    #   A=-1, r=2:   loss 2 < 3, unclipped branch: d(-rA)/dlogp = -rA = 2
    #   A=+1, r=5:   upper clip 1.28 -> loss -1.28, zero gradient (dual clip never touches A > 0)
    #   A=-2, r=0.5: min(-1, -1.6) = -1.6 -> loss 1.6, lower clip, zero gradient
    loss, grad, m = four_tokens(clip_ratio_c=3.0)
    assert loss.item() == pytest.approx((3 + 2 - 1.28 + 1.6) / 4)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 2 / 4, 0.0, 0.0]], dtype=F64))
    assert (m.clipfrac_dual.item(), m.clipfrac_high.item(), m.clipfrac_low.item()) == (0.25, 0.25, 0.25)

    loss, grad, m = four_tokens()  # off: the paper's eq. 10, the A<0, r=5 token keeps its gradient
    assert loss.item() == pytest.approx((5 + 2 - 1.28 + 1.6) / 4)
    torch.testing.assert_close(grad, torch.tensor([[5 / 4, 2 / 4, 0.0, 0.0]], dtype=F64))
    assert m.clipfrac_dual.item() == 0.0


def test_single_token_dual_clip_from_the_brief():
    logprobs = torch.tensor([[5.0]], dtype=F64).log().requires_grad_()
    loss, m = policy_loss(logprobs, torch.zeros(1, 1, dtype=F64), torch.tensor([-1.0], dtype=F64),
                          torch.ones(1, 1), clip_ratio_c=3.0)
    loss.backward()
    assert loss.item() == pytest.approx(3.0) and logprobs.grad.item() == 0.0 and m.clipfrac_dual == 1.0


@pytest.mark.parametrize("c", [1.0, 0.5, -3.0])
def test_dual_clip_bound_must_exceed_one(c):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(x, x, torch.zeros(1), torch.ones(1, 2), clip_ratio_c=c)


def test_log_ratio_clamp():
    """|log r| <= LOG_RATIO_LIMIT = 20: beyond it r is held at e^+-20 and the gradient is zero."""
    assert LOG_RATIO_LIMIT == 20.0
    # fp32: exp(100) overflows to inf, so without the clamp the loss of the first token is inf.
    old = torch.zeros(1, 4)
    logprobs = torch.tensor([[100.0, 19.5, -100.0, -19.5]], requires_grad=True)
    adv = torch.tensor([[-1.0, -1.0, 1.0, 1.0]])
    loss, m = policy_loss(logprobs, old, adv, torch.ones(1, 4))
    loss.backward()
    # losses: |A| e^20 (held), e^19.5 (unclipped, A < 0), -e^-20 (held), -e^-19.5 (unclipped, A > 0)
    want = (math.exp(20) + math.exp(19.5) - math.exp(-20) - math.exp(-19.5)) / 4
    assert torch.isfinite(loss) and loss.item() == pytest.approx(want, rel=1e-6)
    # d loss / d logp = -A r / 4 inside the range, 0 outside
    torch.testing.assert_close(
        logprobs.grad, torch.tensor([[0.0, math.exp(19.5) / 4, 0.0, -math.exp(-19.5) / 4]]), rtol=1e-6, atol=0
    )
    assert m.ratio_max.item() == pytest.approx(math.exp(20), rel=1e-6) and torch.isfinite(m.approx_kl)
    assert torch.exp(logprobs.detach()[0, 0] - old[0, 0]).isinf()  # what the clamp prevents


def test_is_weights_scale_token_terms_not_the_normaliser():
    w = torch.tensor([[0.5, 2.0, 3.0, 0.25]], dtype=F64, requires_grad=True)
    loss, grad, m = four_tokens(clip_ratio_c=3.0, is_weights=w)
    assert loss.item() == pytest.approx((0.5 * 3 + 2.0 * 2 - 3.0 * 1.28 + 0.25 * 1.6) / 4)  # still / 4 tokens
    torch.testing.assert_close(grad, torch.tensor([[0.0, 2.0 * 2 / 4, 0.0, 0.0]], dtype=F64))
    assert w.grad is None  # constants: no gradient reaches the weights
    assert m.num_tokens.item() == 4 and m.clipfrac_dual.item() == 0.25  # metrics ignore the weights


def test_is_weights_ignored_where_masked_and_shape_checked():
    logprobs = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.5, -2.0]], dtype=F64)
    mask = torch.tensor([[1.0, 0.0]])
    is_w = torch.tensor([[2.0, float("nan")]])
    weighted, _ = policy_loss(logprobs, old, torch.ones(1), mask, is_weights=is_w)
    plain, _ = policy_loss(logprobs, old, torch.ones(1), mask)
    torch.testing.assert_close(weighted, 2 * plain)
    with pytest.raises(ValueError, match="is_weights"):
        policy_loss(logprobs, old, torch.ones(1), mask, is_weights=torch.ones(2))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("pieces", [2, 3])
def test_split_invariance_with_dual_clip_and_is_weights(mode, pieces):
    base, old, adv, mask = random_batch(4)
    is_w = torch.rand(base.shape, generator=torch.Generator().manual_seed(5), dtype=F64) * 2
    kw = {"agg_mode": mode, "clip_ratio_c": 1.2}
    full_lp = base.clone().requires_grad_()
    full_loss, m = policy_loss(full_lp, old, adv, mask, is_weights=is_w, **kw)
    full_loss.backward()
    assert m.clipfrac_dual > 0 and m.clipfrac_high > 0 and m.clipfrac_low > 0

    split_lp = base.clone().requires_grad_()
    total = torch.zeros((), dtype=F64)
    for rows in torch.tensor_split(torch.arange(len(base)), pieces):
        loss, _ = policy_loss(split_lp[rows], old[rows], adv[rows], mask[rows], is_weights=is_w[rows],
                              **kw, **global_kwargs(mode, mask))
        loss.backward()
        total += loss.detach()
    torch.testing.assert_close(total, full_loss.detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(split_lp.grad, full_lp.grad, atol=1e-12, rtol=1e-12)


def test_is_weights_equal_an_explicitly_weighted_sum():
    """Independent reference: token-mean with weights = sum_t w_t * l_t / N, l_t the unweighted token loss."""
    base, old, adv, mask = random_batch(6)
    is_w = torch.rand(base.shape, generator=torch.Generator().manual_seed(7), dtype=F64)
    n = int(mask.sum())
    token_losses = torch.stack([
        policy_loss(base[i:i + 1, t:t + 1], old[i:i + 1, t:t + 1], adv[i:i + 1], mask[i:i + 1, t:t + 1],
                    global_num_tokens=1)[0]
        for i in range(base.shape[0]) for t in range(base.shape[1])
    ]).view_as(base)
    loss, _ = policy_loss(base, old, adv, mask, is_weights=is_w)
    torch.testing.assert_close(loss, (token_losses * is_w * mask).sum() / n)


def test_loss_settings_are_resolved_once_from_the_config():
    """One value from the config to the kernel: the variant's defaults filled in, every problem refused at once."""
    from megatron_dapo.algo.loss_settings import LossSettings
    from megatron_dapo.config import AlgoConfig
    from megatron_dapo.kernels import loss_from_logprobs

    assert LossSettings.from_config(AlgoConfig(), 16) == LossSettings("dapo", 0.2, 0.28, "token-mean", None, 16, 0.0)
    cispo = LossSettings.from_config(AlgoConfig(policy_loss="cispo", entropy_coef=0.01), None)
    assert (cispo.eps_low, cispo.eps_high, cispo.entropy_coef) == (0.0, 5.0, 0.01)
    with pytest.raises(ValueError, match="has no dual clip"):
        LossSettings.from_config(AlgoConfig(policy_loss="cispo", clip_ratio_c=3.0), None)
    with pytest.raises(ValueError, match="max_response_len must be >= 1"):
        LossSettings.from_config(AlgoConfig(policy_loss="dr_grpo"), None)
    lp = torch.zeros(2, 3)
    settings = LossSettings.resolve(eps_high=0.3)
    by_value = loss_from_logprobs(lp, None, lp, torch.ones(2), torch.ones(2, 3), settings)[0]
    by_keywords = loss_from_logprobs(lp, None, lp, torch.ones(2), torch.ones(2, 3), eps_high=0.3)[0]
    assert by_value == by_keywords == policy_loss(lp, lp, torch.ones(2), torch.ones(2, 3), eps_high=0.3)[0]
    with pytest.raises(TypeError, match="not both"):
        loss_from_logprobs(lp, None, lp, torch.ones(2), torch.ones(2, 3), settings, eps_high=0.3)
