"""The CPU shims the SGLang venv loads (megatron_dapo/rollout/sglang/cpu_shims/), tested without SGLang: the
sgl_kernel stand-in's two ops, the import hook, and the memory-saver emulation (a released region's content
is lost, as on CUDA)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def test_cpu_standin_ops_match_their_definition():
    from megatron_dapo.rollout.sglang.cpu_shims import sgl_kernel_cpu_standin as k

    req_to_token = torch.zeros(4, 10, dtype=torch.int32)
    k.assign_req_to_token_pool_cpu(torch.tensor([2, 0]), req_to_token, torch.tensor([1, 0]),
                                   torch.tensor([4, 2]), torch.tensor([7, 8, 9, 5, 6]), 10)
    assert req_to_token[2, 1:4].tolist() == [7, 8, 9] and req_to_token[0, :2].tolist() == [5, 6]
    assert int(req_to_token.count_nonzero()) == 5

    bufs = [torch.randn(6, 4), torch.randn(6, 2, 8, dtype=torch.float64)]  # per-layer KV buffers
    expected = [b.clone() for b in bufs]
    src, tgt = torch.tensor([0, 1, 3]), torch.tensor([3, 5, 1])  # overlapping: 3 is read and written
    for e in expected:
        e[tgt] = e[src].clone()
    k.copy_all_layer_kv_cache_cpu(torch.tensor([b.data_ptr() for b in bufs]),
                                  torch.tensor([b[0].numel() * b.element_size() for b in bufs]), tgt, src)
    for b, e in zip(bufs, expected):
        assert torch.equal(b, e)
    with pytest.raises(NotImplementedError, match="no CPU stand-in"):
        k.fused_experts_cpu(torch.zeros(1))


def test_cpu_shim_hook_serves_sgl_kernel_and_patches_device_module(tmp_path):
    """What the venv's .pth does, in this python: inactive without SGLANG_USE_CPU_ENGINE=1."""
    src = REPO / "megatron_dapo" / "rollout" / "sglang" / "cpu_shims"
    (tmp_path / "megatron_dapo_sglang_cpu.py").write_text((src / "megatron_dapo_sglang_cpu.py").read_text())
    (tmp_path / "megatron_dapo_sgl_kernel_cpu_standin.py").write_text(
        (src / "sgl_kernel_cpu_standin.py").read_text())
    probe = textwrap.dedent("""
        import importlib.util, megatron_dapo_sglang_cpu
        megatron_dapo_sglang_cpu.install()
        if importlib.util.find_spec("sgl_kernel") is None:
            print("inactive")
        else:
            import sgl_kernel, torch
            print(sgl_kernel.__file__.endswith("megatron_dapo_sgl_kernel_cpu_standin.py"),
                  torch.get_device_module() is torch.cpu, hasattr(torch.get_device_module, "__wrapped__"),
                  callable(sgl_kernel.assign_req_to_token_pool_cpu))
    """)
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    env["PYTHONPATH"] = str(tmp_path)
    run = [sys.executable, "-c", probe]
    off = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120, check=True)
    on = subprocess.run(run, env={**env, "SGLANG_USE_CPU_ENGINE": "1"}, capture_output=True, text=True,
                        timeout=120, check=True)
    assert off.stdout.split() == ["inactive"]
    assert on.stdout.split() == ["True", "True", "True", "True"]



def _fake_weight_updater_module():
    """The parts of sglang.srt.managers.scheduler_components.weight_updater the shim touches."""
    module = types.SimpleNamespace(GPU_MEMORY_TYPE_WEIGHTS="weights", GPU_MEMORY_TYPE_KV_CACHE="kv_cache",
                                   GPU_MEMORY_ALL_TYPES=["weights", "kv_cache", "cuda_graph"])
    pool = types.SimpleNamespace(k_buffer=[torch.ones(4, 2)], v_buffer=[torch.ones(4, 2)])
    runner = types.SimpleNamespace(model=torch.nn.Linear(3, 2), token_to_kv_pool=pool)

    class SchedulerWeightUpdaterManager:
        tp_worker = types.SimpleNamespace(model_runner=runner)

        def release_memory_occupation(self, recv_req):
            return "released"

    module.SchedulerWeightUpdaterManager = SchedulerWeightUpdaterManager
    return module, runner


@pytest.mark.parametrize("tags, backup, lost", [(None, False, {"weights", "kv"}), (["kv_cache"], False, {"kv"}),
                                                (["weights"], False, {"weights"}), (None, True, {"kv"})])
def test_a_released_region_comes_back_lost_unless_backed_up(monkeypatch, tags, backup, lost):
    from megatron_dapo.rollout.sglang.cpu_shims import megatron_dapo_sglang_cpu as shim

    module, runner = _fake_weight_updater_module()
    monkeypatch.setattr(shim, "_weights_backup", lambda: backup)
    shim.lose_released_memory(module)
    shim.lose_released_memory(module)  # patched once
    assert module.SchedulerWeightUpdaterManager().release_memory_occupation(
        types.SimpleNamespace(tags=tags)) == "released"
    weights_nan = all(p.isnan().all() for p in runner.model.parameters())
    kv_nan = all(t.isnan().all() for t in (*runner.token_to_kv_pool.k_buffer, *runner.token_to_kv_pool.v_buffer))
    assert {"weights"} & lost == ({"weights"} if weights_nan else set())
    assert ("kv" in lost) == kv_nan
