"""Vocab-parallel logprob / entropy / DAPO loss on 2 gloo ranks equals the single-process oracle.

Each rank holds a vocab shard (uneven on purpose: 250 + 350 ids) of the same logits, and of the
lm-head weight for the linear variant; targets fall in both shards. Values must agree on both ranks
and each rank's gradient must be its slice of the full-vocab oracle gradient (the hidden-state
gradient, all-reduced, the full one). The torch path and the Triton interpreter run in one spawn.

As in the actor, a rank's logits are a slice of Megatron's padded vocab partition: the valid
columns of a [.., width] tensor whose padding holds garbage. In the second layout rank 1's
partition is padding only (Megatron pads a small vocabulary to 128 x TP): zero valid columns.
"""

from __future__ import annotations

import importlib.util
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from spawn import run_ranks

UNEVEN = ((0, 250, 250), (250, 350, 350))  # per rank: (vocab_start, valid columns, partition width)
PADDING_ONLY = ((0, 600, 640), (640, 0, 640))
B, T, V = 3, 5, 600
LOSS_KW: dict[str, Any] = {"eps_low": 0.2, "eps_high": 0.28, "global_num_tokens": 11, "entropy_coef": 0.01}


def _inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(B, T, V, generator=gen)
    targets = torch.randint(0, V, (B, T), generator=gen)
    targets[0, :2] = torch.tensor([0, V - 1])  # both ends of the vocab
    return {
        "logits": logits,
        "targets": targets,
        "g_lp": torch.randn(B, T, generator=gen),
        "g_ent": torch.randn(B, T, generator=gen),
        "old": torch.randn(B, T, generator=gen) - 6.0,
        "advantages": torch.tensor([1.0, -1.0, 0.5]),
        "mask": (torch.rand(B, T, generator=gen) > 0.3).float(),
        "hidden": torch.randn(B, T, 16, generator=gen),
        "weight": torch.randn(V, 16, generator=gen),
    }


def _oracle(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from megatron_dapo.algo.loss import policy_loss
    from megatron_dapo.kernels.reference import reference_logprobs_and_entropy

    x = d["logits"].clone().requires_grad_()
    lp, ent = reference_logprobs_and_entropy(x, d["targets"])
    ((lp * d["g_lp"]).sum() + (ent * d["g_ent"]).sum()).backward()
    x_lp = d["logits"].clone().requires_grad_()
    (reference_logprobs_and_entropy(x_lp, d["targets"])[0] * d["g_lp"]).sum().backward()
    y = d["logits"].clone().requires_grad_()
    lp2, ent2 = reference_logprobs_and_entropy(y, d["targets"])
    kw = {k: v for k, v in LOSS_KW.items() if k != "entropy_coef"}
    loss, _ = policy_loss(lp2, d["old"], d["advantages"], d["mask"], agg_mode="token-mean", **kw)
    loss = loss - LOSS_KW["entropy_coef"] * (ent2 * d["mask"]).sum() / LOSS_KW["global_num_tokens"]
    loss.backward()
    h, w = d["hidden"].clone().requires_grad_(), d["weight"].clone().requires_grad_()
    lp3, ent3 = reference_logprobs_and_entropy(h @ w.T, d["targets"])
    ((lp3 * d["g_lp"]).sum() + (ent3 * d["g_ent"]).sum()).backward()
    h_lp, w_lp = d["hidden"].clone().requires_grad_(), d["weight"].clone().requires_grad_()
    (reference_logprobs_and_entropy(h_lp @ w_lp.T, d["targets"])[0] * d["g_lp"]).sum().backward()
    return {
        "lp": lp.detach(), "ent": ent.detach(), "grad": x.grad, "grad_lp_only": x_lp.grad,
        "loss": loss.detach(), "loss_grad": y.grad,
        "linear_lp": lp3.detach(), "linear_ent": ent3.detach(), "grad_h": h.grad, "grad_w": w.grad,
        "grad_h_lp_only": h_lp.grad, "grad_w_lp_only": w_lp.grad,
    }  # fmt: skip


def _local_logits(d: dict[str, torch.Tensor], start: int, valid: int, width: int) -> torch.Tensor:
    """This rank's padded partition [B, T, width] (leaf): valid logits, then large garbage."""
    local = torch.full((B, T, width), 50.0)
    local[..., :valid] = d["logits"][..., start : start + valid]
    return local.requires_grad_()


def _check_logprobs(impl, shard, d, want, entropy: bool) -> None:
    from megatron_dapo.kernels import token_logprobs_and_entropy

    start, valid, width = shard
    local = _local_logits(d, start, valid, width)
    lp, ent = token_logprobs_and_entropy(local[..., :valid], d["targets"], tp_group=dist.group.WORLD,
                                         vocab_start=start, impl=impl, compute_entropy=entropy)
    torch.testing.assert_close(lp.detach(), want["lp"], atol=2e-5, rtol=2e-6)
    if entropy:
        torch.testing.assert_close(ent.detach(), want["ent"], atol=2e-5, rtol=2e-6)
        ((lp * d["g_lp"]).sum() + (ent * d["g_ent"]).sum()).backward()
    else:
        assert ent is None
        (lp * d["g_lp"]).sum().backward()
    full = want["grad"] if entropy else want["grad_lp_only"]
    mine = full[..., start : start + valid]
    torch.testing.assert_close(local.grad[..., :valid], mine, atol=1e-6, rtol=1e-5)
    assert not local.grad[..., valid:].any()  # the padding gets no gradient


def _check_linear(impl, shard, d, want, entropy: bool) -> None:
    """The fused output projection: weight sharded by vocab, hidden replicated, grad_hidden all-reduced."""
    from megatron_dapo.kernels import linear_logprobs_and_entropy

    start, valid, _ = shard
    h = d["hidden"].clone().requires_grad_()
    w = d["weight"][start : start + valid].clone().requires_grad_()  # [0, H] on a padding-only rank
    tp = {"tp_group": dist.group.WORLD, "vocab_start": start, "impl": impl, "compute_entropy": entropy}
    lp, ent = linear_logprobs_and_entropy(h, w, d["targets"], chunk_bytes=4 * 350 * 4, **tp)
    torch.testing.assert_close(lp.detach(), want["linear_lp"], atol=2e-5, rtol=2e-6)
    if entropy:
        torch.testing.assert_close(ent.detach(), want["linear_ent"], atol=2e-5, rtol=2e-6)
        ((lp * d["g_lp"]).sum() + (ent * d["g_ent"]).sum()).backward()
    else:
        assert ent is None
        (lp * d["g_lp"]).sum().backward()
    suffix = "" if entropy else "_lp_only"
    torch.testing.assert_close(h.grad, want["grad_h" + suffix], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad, want["grad_w" + suffix][start : start + valid], atol=1e-5, rtol=1e-5)


def _check_loss(impl, shard, d, want) -> None:
    from megatron_dapo.kernels import fused_policy_loss

    start, valid, width = shard
    local = _local_logits(d, start, valid, width)
    loss, metrics = fused_policy_loss(local[..., :valid], d["targets"], d["old"], d["advantages"], d["mask"],
                                      tp_group=dist.group.WORLD, vocab_start=start, impl=impl, **LOSS_KW)
    loss.backward()
    torch.testing.assert_close(loss.detach(), want["loss"], atol=1e-6, rtol=1e-6)
    grad = local.grad[..., :valid]
    torch.testing.assert_close(grad, want["loss_grad"][..., start : start + valid], atol=1e-7, rtol=1e-5)
    assert not local.grad[..., valid:].any()
    entropy_mean = (want["ent"] * d["mask"]).sum() / d["mask"].sum()
    torch.testing.assert_close(metrics.entropy, entropy_mean, atol=2e-5, rtol=2e-6)


def _check_rank(impl: str, shard: tuple[int, int, int], d: dict[str, torch.Tensor], want) -> None:
    for entropy in (True, False):
        _check_logprobs(impl, shard, d, want, entropy)
        _check_linear(impl, shard, d, want, entropy)
    _check_loss(impl, shard, d, want)


def _worker(rank: int, world_size: int, port: int, impls: list[str], shards) -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # before the Triton kernels are imported (lazily, on first use)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        torch.set_num_threads(1)
        d = _inputs()
        want = _oracle(d)
        for impl in impls:
            _check_rank(impl, shards[rank], d, want)
    finally:
        dist.destroy_process_group()


IMPLS = ["torch"] + (["triton"] if importlib.util.find_spec("triton") else [])


def test_vocab_parallel_two_gloo_ranks_match_single_process():
    run_ranks(_worker, IMPLS, UNEVEN)


def test_a_padding_only_partition_contributes_nothing():
    """Rank 1 holds no valid column (logits [B, T, 0], weight [0, H]): values are the full-vocab ones,
    its gradient is empty, forward and backward, entropy on and off, every kernel path."""
    run_ranks(_worker, IMPLS, PADDING_ONLY)


def test_single_rank_group_is_local():
    """tp_group=None (or a 1-rank world) means the shard is the whole vocab: no communication."""
    from megatron_dapo.kernels import token_logprobs_and_entropy
    from megatron_dapo.kernels.reference import reference_logprobs_and_entropy

    d = _inputs()
    lp, ent = token_logprobs_and_entropy(d["logits"], d["targets"], tp_group=None, impl="torch")
    want_lp, want_ent = reference_logprobs_and_entropy(d["logits"], d["targets"])
    torch.testing.assert_close(lp, want_lp, atol=2e-5, rtol=2e-6)
    torch.testing.assert_close(ent, want_ent, atol=2e-5, rtol=2e-6)
