"""CUDA-only: the Transformer Engine layer spec in bf16 against the local spec in fp32 (same HF weights), and
TE's packed rows (Megatron's thd format) against its right-padded batch."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

WORKER = Path(__file__).parent / "workers" / "actor_gpu_worker.py"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_te_bf16_logprobs_match_local_fp32(tmp_path, python_env):
    pytest.importorskip("transformer_engine")
    from workers.actor_worker import VOCAB

    from megatron_dapo.tiny import save_tiny_model

    save_tiny_model(tmp_path / "hf", "qwen2", seed=0, vocab_size=VOCAB)
    env = {**python_env, "PYTHONPATH": f"{Path(__file__).parent}{os.pathsep}{python_env['PYTHONPATH']}"}
    r = subprocess.run([sys.executable, str(WORKER), str(tmp_path / "hf"), str(tmp_path / "out.pt")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    res = torch.load(tmp_path / "out.pt")
    valid = torch.arange(16)[None, 1:] < torch.tensor([16, 11, 9, 16, 6, 13, 8, 12])[:, None]
    diff = (res["te"][0][:, 1:] - res["local"][0][:, 1:])[valid].abs()
    assert diff.mean() < 0.05 and diff.max() < 0.3  # bf16 weights and activations
    assert res["te_metrics"]["update_ok"] == 1.0
    # the rows packed in thd format (cu_seqlens through TE's attention): the padded batch's function, no padding
    packed = (res["te"][0][:, 1:] - res["te_padded"][0][:, 1:])[valid].abs()
    assert packed.mean() < 0.02 and packed.max() < 0.2
    assert res["te_metrics"]["perf/pad_frac"] == 0.0 < res["te_padded_metrics"]["perf/pad_frac"]
    assert torch.isfinite(res["te_after_wake"]).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_te_grouped_experts_match_the_sequential_ones(tmp_path, python_env):
    """A Qwen3-MoE's experts as TE's GroupedLinear (one grouped GEMM per layer) load and export the HF weights bit
    for bit, compute the sequential experts' logprobs, and take the same update."""
    pytest.importorskip("transformer_engine")
    from workers.actor_worker import VOCAB

    from megatron_dapo.actor.hf_mapping import Naming
    from megatron_dapo.hf_files import SafetensorsReader
    from megatron_dapo.tiny import save_tiny_model

    hf = save_tiny_model(tmp_path / "hf", "qwen3_moe", seed=0, vocab_size=VOCAB)
    env = {**python_env, "PYTHONPATH": f"{Path(__file__).parent}{os.pathsep}{python_env['PYTHONPATH']}"}
    r = subprocess.run([sys.executable, str(WORKER), str(hf), str(tmp_path / "out.pt"), "moe"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    res = torch.load(tmp_path / "out.pt", weights_only=False)
    assert res["grouped_naming"] == Naming(te=True, grouped=True) and res["sequential_naming"].grouped is False
    reader = SafetensorsReader(hf)
    for name, t in res["grouped_export"].items():  # the bf16 actor holds the HF weights, rounded to bf16 once
        assert torch.equal(t, reader.get(name).to(t.dtype)), name
    valid = torch.arange(16)[None, 1:] < torch.tensor([16, 11, 9, 16, 6, 13, 8, 12])[:, None]
    diff = (res["grouped"][0][:, 1:] - res["sequential"][0][:, 1:])[valid].abs()
    assert diff.mean() < 0.02 and diff.max() < 0.2  # bf16 GEMMs in another order
    assert res["grouped_metrics"]["update_ok"] == 1.0
    moved = [(res["grouped_after"][n].float() - res["sequential_after"][n].float()).abs().max()
             for n in res["grouped_after"]]
    assert max(moved) < 0.02
