"""The DAPO policy loss against hand arithmetic from the paper, and its split invariance."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from spawn import run_ranks

from megatron_dapo.algo.loss import policy_loss

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


def random_batch(seed: int, B: int = 11, T: int = 37):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=gen, dtype=F64) * 3
    noise = torch.randn(B, T, generator=gen, dtype=F64) * 0.3  # large enough to hit both clips
    lengths = torch.randint(0, T + 1, (B,), generator=gen)
    lengths[3] = 0  # a fully masked row (e.g. overlong-filtered)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float32)
    adv = torch.randn(B, generator=gen, dtype=F64)
    return old + noise, old, adv, mask


def global_kwargs(mode: str, mask: torch.Tensor) -> dict:
    if mode == "token-mean":
        return {"global_num_tokens": int(mask.sum())}
    return {"global_num_seqs": int((mask.sum(-1) > 0).sum())}


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


def _dp_worker(rank: int, world_size: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        # A shared "model" theta makes logprobs depend on parameters every rank holds, as in DP.
        base, old, adv, mask = random_batch(3, B=10)
        theta = torch.zeros(base.shape[1], dtype=F64, requires_grad=True)
        ref_loss, _ = policy_loss(base + theta, old, adv, mask)
        (ref_grad,) = torch.autograd.grad(ref_loss, theta)

        rows = slice(rank * 5, (rank + 1) * 5)
        num_tokens = mask[rows].sum().to(F64)
        dist.all_reduce(num_tokens)
        loss, _ = policy_loss(base[rows] + theta, old[rows], adv[rows], mask[rows], global_num_tokens=num_tokens)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        dist.all_reduce(theta.grad)
        torch.testing.assert_close(total, ref_loss.detach(), atol=1e-6, rtol=0)
        torch.testing.assert_close(theta.grad, ref_grad, atol=1e-6, rtol=0)
    finally:
        dist.destroy_process_group()


def test_two_rank_gloo_data_parallel_matches_full_batch():
    run_ranks(_dp_worker)


def test_empty_batch_gives_zero_loss_and_metrics():
    empty = torch.zeros(0, 3)
    loss, m = policy_loss(empty, empty, torch.zeros(0), empty)
    assert loss.item() == 0.0 and m.num_tokens.item() == 0 and m.ratio_max.item() == 0
