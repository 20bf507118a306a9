"""Shared by the kernel tests (test_kernels.py: logprobs + entropy; test_kernels_loss.py: the DAPO loss):
the implementation fixtures (torch, Triton in the interpreter, both on CUDA in the `gpu` tier), inputs,
and the fp32-oracle comparison. Tolerances: see test_kernels.py's docstring."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from megatron_dapo.kernels import token_logprobs_and_entropy
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


