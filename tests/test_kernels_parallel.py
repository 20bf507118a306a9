"""Vocab-parallel logprob / entropy / DAPO loss on 2 gloo ranks equals the single-process oracle.

Each rank holds a vocab shard (uneven on purpose: 250 + 350 ids) of the same logits, and of the
lm-head weight for the linear variant; targets fall in both shards. Values must agree on both ranks
and each rank's gradient must be its slice of the full-vocab oracle gradient (the hidden-state
gradient, all-reduced, the full one). The torch path and the Triton interpreter run in one spawn.
"""

from __future__ import annotations

import importlib.util
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from spawn import run_ranks

SHARDS = ((0, 250), (250, 600))
B, T, V = 3, 5, 600
LOSS_KW = {"eps_low": 0.2, "eps_high": 0.28, "global_num_tokens": 11, "entropy_coef": 0.01}


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
    y = d["logits"].clone().requires_grad_()
    lp2, ent2 = reference_logprobs_and_entropy(y, d["targets"])
    kw = {k: v for k, v in LOSS_KW.items() if k != "entropy_coef"}
    loss, _ = policy_loss(lp2, d["old"], d["advantages"], d["mask"], agg_mode="token-mean", **kw)
    loss = loss - LOSS_KW["entropy_coef"] * (ent2 * d["mask"]).sum() / LOSS_KW["global_num_tokens"]
    loss.backward()
    h, w = d["hidden"].clone().requires_grad_(), d["weight"].clone().requires_grad_()
    lp3, ent3 = reference_logprobs_and_entropy(h @ w.T, d["targets"])
    ((lp3 * d["g_lp"]).sum() + (ent3 * d["g_ent"]).sum()).backward()
    return {
        "lp": lp.detach(), "ent": ent.detach(), "grad": x.grad, "loss": loss.detach(), "loss_grad": y.grad,
        "linear_lp": lp3.detach(), "linear_ent": ent3.detach(), "grad_h": h.grad, "grad_w": w.grad,
    }  # fmt: skip


def _check_rank(impl: str, rank: int, d: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    from megatron_dapo.kernels import (
        fused_policy_loss,
        linear_logprobs_and_entropy,
        token_logprobs_and_entropy,
    )

    start, end = SHARDS[rank]
    tp = {"tp_group": dist.group.WORLD, "vocab_start": start, "impl": impl}
    shard = d["logits"][..., start:end].clone().requires_grad_()
    lp, ent = token_logprobs_and_entropy(shard, d["targets"], **tp)
    ((lp * d["g_lp"]).sum() + (ent * d["g_ent"]).sum()).backward()
    torch.testing.assert_close(lp.detach(), want["lp"], atol=2e-5, rtol=2e-6)
    torch.testing.assert_close(ent.detach(), want["ent"], atol=2e-5, rtol=2e-6)
    torch.testing.assert_close(shard.grad, want["grad"][..., start:end], atol=1e-6, rtol=1e-5)

    shard = d["logits"][..., start:end].clone().requires_grad_()
    loss, metrics = fused_policy_loss(
        shard, d["targets"], d["old"], d["advantages"], d["mask"], **tp, **LOSS_KW
    )
    loss.backward()
    torch.testing.assert_close(loss.detach(), want["loss"], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(shard.grad, want["loss_grad"][..., start:end], atol=1e-7, rtol=1e-5)
    entropy_mean = (want["ent"] * d["mask"]).sum() / d["mask"].sum()
    torch.testing.assert_close(metrics.entropy, entropy_mean, atol=2e-5, rtol=2e-6)

    # The fused output projection: weight sharded by vocab, hidden replicated, grad_hidden all-reduced.
    h = d["hidden"].clone().requires_grad_()
    w = d["weight"][start:end].clone().requires_grad_()
    lp, ent = linear_logprobs_and_entropy(h, w, d["targets"], chunk_bytes=4 * 350 * 4, **tp)
    ((lp * d["g_lp"]).sum() + (ent * d["g_ent"]).sum()).backward()
    torch.testing.assert_close(lp.detach(), want["linear_lp"], atol=2e-5, rtol=2e-6)
    torch.testing.assert_close(ent.detach(), want["linear_ent"], atol=2e-5, rtol=2e-6)
    torch.testing.assert_close(h.grad, want["grad_h"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad, want["grad_w"][start:end], atol=1e-5, rtol=1e-5)


def _worker(rank: int, world_size: int, port: int, impls: list[str]) -> None:
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
            _check_rank(impl, rank, d, want)
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_two_gloo_ranks_match_single_process():
    impls = ["torch"] + (["triton"] if importlib.util.find_spec("triton") else [])
    run_ranks(_worker, impls)


def test_single_rank_group_is_local():
    """tp_group=None (or a 1-rank world) means the shard is the whole vocab: no communication."""
    from megatron_dapo.kernels import token_logprobs_and_entropy
    from megatron_dapo.kernels.reference import reference_logprobs_and_entropy

    d = _inputs()
    lp, ent = token_logprobs_and_entropy(d["logits"], d["targets"], tp_group=None, impl="torch")
    want_lp, want_ent = reference_logprobs_and_entropy(d["logits"], d["targets"])
    torch.testing.assert_close(lp, want_lp, atol=2e-5, rtol=2e-6)
    torch.testing.assert_close(ent, want_ent, atol=2e-5, rtol=2e-6)
