"""CUDA only: SGLang colocated on the GPU, as the trainer drives it on a cluster: CUDA-IPC weight updates
(tensor transport: the server maps this process's GPU memory) and real memory release / resume.

Needs a CUDA SGLang install: $MEGATRON_DAPO_SGLANG_PYTHON, else the venv of tools/sglang_venv.sh (see
`default_python`). float32 with the torch-native attention backend, so logprobs compare at 1e-4.
"""

from __future__ import annotations

import time

import pytest
import torch
from sglang_support import SGLANG_TIMEOUT, _gone, _max_logprob_diff, server_ports

from megatron_dapo.config import SGLangConfig
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.sglang.engine import SGLangEngine
from megatron_dapo.rollout.sglang.server import default_python

pytestmark = [pytest.mark.gpu, pytest.mark.sglang,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[5, 6, 7], [9, 9], [17, 33, 65, 129, 200]]


def _gpu_used_mib() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


@pytest.fixture(scope="module")
def cuda_hf(models):
    from transformers import AutoModelForCausalLM

    return {k: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).cuda().eval() for k, p in models.items()}


@SGLANG_TIMEOUT
def test_colocated_cuda_ipc_updates_and_release_resume(models, cuda_hf, tmp_path):
    cfg = SGLangConfig(mem_fraction_static=0.3, startup_timeout_s=900, request_timeout_s=300)
    t0 = time.monotonic()
    engine = SGLangEngine(models["a"], cfg, python=default_python(), port=server_ports(), dtype="float32",
                          device="cuda", colocate=True, log_dir=tmp_path / "logs", bucket_mb=1,
                          extra_args=["--attention-backend", "torch_native", "--disable-cuda-graph"])
    print(f"\nSGLang on CUDA up in {time.monotonic() - t0:.1f} s; log {engine.log_path}")
    pid = engine.pid
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
    try:
        assert _max_logprob_diff(cuda_hf["a"], engine.generate(PROMPTS, 2, sampling)) < 1e-4

        # CUDA tensors travel as IPC handles; bucket_mb=1 makes several buckets
        engine.update_weights(cuda_hf["b"].state_dict().items(), transport="tensor")
        assert engine.last_update.buckets >= 2 and engine.last_update.bytes > 0
        assert _max_logprob_diff(cuda_hf["b"], engine.generate(PROMPTS, 2, sampling)) < 1e-4

        before = _gpu_used_mib()
        engine.sleep()
        released = before - _gpu_used_mib()
        print(f"release_memory_occupation freed {released:.0f} MiB of {before:.0f} MiB in use")
        assert released > 0.2 * cfg.mem_fraction_static * torch.cuda.mem_get_info()[1] / 2**20
        engine.wake()
        assert _gpu_used_mib() > before - 0.5 * released  # the memory is taken back
        engine.update_weights(cuda_hf["b"].state_dict().items(), transport="tensor")  # as the trainer does
        assert _max_logprob_diff(cuda_hf["b"], engine.generate(PROMPTS, 2, sampling)) < 1e-4
    finally:
        engine.shutdown()
    assert _gone(pid)
