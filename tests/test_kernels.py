"""Fused logprob / entropy / DAPO-loss kernels against the plain-torch fp32 oracle: values AND gradients.

Every check runs on each implementation: the chunked torch path, the Triton kernels in the CPU
interpreter (TRITON_INTERPRET=1, small shapes), and (`gpu` tier) both on CUDA with real launches.

Tolerances: all kernels compute in fp32 from the input logits, so values match the fp32 oracle to
fp32 rounding whatever the input dtype. Gradients are returned in the logits' dtype: fp16/bf16
gradients may differ from the oracle's (rounded from fp32) by 1 ulp, and the Triton interpreter
truncates fp32->bf16 stores instead of rounding, so GRAD_RTOL is 1-2 ulp of the dtype.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from kernel_support import (  # noqa: F401 - impl and split are fixtures
    HAS_TRITON, VALUE_TOL, assert_matches_oracle, fwd_bwd, impl, make_logits, make_targets, split,
)

from megatron_dapo.kernels import linear_logprobs_and_entropy, resolve_impl, token_logprobs_and_entropy
from megatron_dapo.kernels.reference import reference_logprobs_and_entropy


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


@pytest.mark.parametrize("keep_bytes", [0, None], ids=["recomputed", "kept"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_matches_oracle_on_materialised_logits(impl, dtype, keep_bytes):
    """hidden @ weight^T in token chunks (3 rows each) + kernels == the oracle on the full logits, the
    backward recomputing each chunk's logits (keep_bytes=0) or taking the forward's (they fit the budget).

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

    got = run(lambda h, w: linear_logprobs_and_entropy(h, w, targets, impl=impl[0], chunk_bytes=3 * 300 * 4,
                                                       keep_bytes=keep_bytes))
    want = run(lambda h, w: reference_logprobs_and_entropy(h @ w.T, targets))
    tol = VALUE_TOL if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), **tol)



@pytest.mark.parametrize(("keep_bytes", "backward_matmuls"),
                         [(0, 4 * 3), (10 * 300 * 4, 2), (10 * 300 * 4 - 1, 4 * 3)])
def test_the_backward_recomputes_the_logits_only_when_they_exceed_the_keep_budget(keep_bytes, backward_matmuls):
    """10 rows in chunks of 3: recomputed, each chunk takes the logits matmul again plus grad_hidden and
    grad_weight (4 chunks x 3); kept (all 10 rows' fp32 logits fit keep_bytes), the one block's two."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Matmuls(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Matmuls.count += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm,
                                                     torch.ops.aten.addmm_)
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    h = torch.randn(10, 16, generator=gen, requires_grad=True)
    w = torch.randn(300, 16, generator=gen, requires_grad=True)
    lp, ent = linear_logprobs_and_entropy(h, w, make_targets((10,), 300, "cpu"), impl="torch",
                                          chunk_bytes=3 * 300 * 4, keep_bytes=keep_bytes)
    with Matmuls():
        (lp.sum() + ent.sum()).backward()
    assert Matmuls.count == backward_matmuls


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
