"""CUDA only: SGLang colocated on the GPU, as the trainer drives it on a cluster: CUDA-IPC weight updates
(tensor transport: the server maps this process's GPU memory) and real memory release / resume.

Needs a CUDA SGLang install: $MEGATRON_DAPO_SGLANG_PYTHON, else the venv of tools/sglang_venv.sh (see
`default_python`). float32 with the torch-native attention backend, so logprobs compare at 1e-4.
"""

from __future__ import annotations

import time

import pytest
import torch
from sglang_support import SGLANG_TIMEOUT, process_gone, max_logprob_diff, server_ports

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
        assert max_logprob_diff(cuda_hf["a"], engine.generate(PROMPTS, 2, sampling)) < 1e-4

        # CUDA tensors travel as IPC handles; bucket_mb=1 makes several buckets
        engine.update_weights(cuda_hf["b"].state_dict().items(), transport="tensor")
        assert engine.last_update.buckets >= 2 and engine.last_update.bytes > 0
        assert max_logprob_diff(cuda_hf["b"], engine.generate(PROMPTS, 2, sampling)) < 1e-4

        before = _gpu_used_mib()
        engine.sleep()
        released = before - _gpu_used_mib()
        print(f"release_memory_occupation freed {released:.0f} MiB of {before:.0f} MiB in use")
        assert released > 0.2 * cfg.mem_fraction_static * torch.cuda.mem_get_info()[1] / 2**20
        engine.wake()
        assert _gpu_used_mib() > before - 0.5 * released  # the memory is taken back
        engine.update_weights(cuda_hf["b"].state_dict().items(), transport="tensor")  # as the trainer does
        assert max_logprob_diff(cuda_hf["b"], engine.generate(PROMPTS, 2, sampling)) < 1e-4
    finally:
        engine.shutdown()
    assert process_gone(pid)


def _per_rank_worker(rank, world, port, url_port, model_b, api_key, out):
    """A trainer rank that sees only its own GPU (as under Slurm: CUDA_VISIBLE_DEVICES per task, so its
    device ordinal is 0 either way): it serialises the payload of the server TP rank on its GPU."""
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    import json
    from pathlib import Path

    import torch.distributed as dist
    from safetensors.torch import load_file

    from megatron_dapo.rollout.sglang.updates import NodeLayout, NodeWeightSync

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group([0, 1], backend="gloo")
    servers = []
    if rank == 0:
        servers = [SGLangEngine(Path(model_b), SGLangConfig(tensor_parallel=2), port=url_port, attach=True,
                                device="cuda", api_key=api_key)]
    weights = {n: t.cuda() for n, t in load_file(str(Path(model_b) / "model.safetensors")).items()}
    layout = NodeLayout(node=0, ranks=(0, 1), servers=1, tp=2, colocated=True)
    sync = NodeWeightSync(servers, layout, rank, transport="tensor", bucket_bytes=2**20, group=group)
    counts = sync.update(weights.items())
    result = {"error": repr(counts.error) if counts.error else None, "sent": counts.sent,
              "buckets": counts.buckets}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@SGLANG_TIMEOUT
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_each_rank_serialises_its_server_ranks_payload_by_device_uuid(models, tmp_path):
    """SGLang TP=2 on GPUs 0 and 1; two trainer ranks, each seeing only its own GPU (ordinal 0 in both), each
    send the payload of the server rank on their GPU; the device travels as its UUID, so each server rank maps
    its own GPU's memory (ordinals would both name the server's GPU 0)."""
    import json

    from spawn import run_ranks
    from transformers import AutoModelForCausalLM

    key = "k" * 32
    engine = SGLangEngine(models["a"], SGLangConfig(tensor_parallel=2, mem_fraction_static=0.3,
                                                    startup_timeout_s=900, request_timeout_s=300),
                          python=default_python(), port=server_ports(), dtype="float32", device="cuda",
                          colocate=True, log_dir=tmp_path / "logs", api_key=key,
                          extra_args=["--attention-backend", "torch_native", "--disable-cuda-graph"])
    hf_b = AutoModelForCausalLM.from_pretrained(models["b"], dtype=torch.float32).eval()
    try:
        run_ranks(_per_rank_worker, engine.port, str(models["b"]), key, str(tmp_path), timeout_s=600)
        r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
        assert r0["error"] is None and r1["error"] is None and r0["sent"] == r1["sent"] > 0
        sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
        assert max_logprob_diff(hf_b, engine.generate(PROMPTS, 2, sampling)) < 1e-4
    finally:
        engine.shutdown()
