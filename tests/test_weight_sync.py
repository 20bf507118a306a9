"""Actor -> embedded engine weight sync at TP1 / TP2 / PP2: after a sync the engine's logprobs of its
own samples equal the (trained) actor's teacher-forced logprobs."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_dapo.parallel import free_port
from megatron_dapo.tiny import save_tiny_model

WORKER = Path(__file__).parent / "workers" / "sync_worker.py"
RUN_WORKER = Path(__file__).parent / "workers" / "sync_run_worker.py"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("hf"), "qwen2", vocab_size=200, max_position_embeddings=128,
                           eos_token_id=199)


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama", tied=True, vocab_size=200,
                           max_position_embeddings=128, eos_token_id=199)


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_engine_matches_actor_after_sync(hf_dir, tmp_path, python_env, tp, pp):
    res = run_sync(hf_dir, tmp_path, python_env, tp, pp)
    assert res["tensors"] == 2 * 12 + 3  # 12 HF tensors per layer (qkv biases), embeddings, norm, lm_head


def test_tied_embeddings_across_pipeline_stages(tied_llama_dir, tmp_path, python_env):
    """PP=2 with tied embeddings: the last stage's copy of the embedding loads, trains and is not exported twice."""
    res = run_sync(tied_llama_dir, tmp_path, python_env, 1, 2)
    assert res["tensors"] == 2 * 9 + 2  # no biases, no lm_head


@pytest.mark.parametrize("nodes", [1, 2], ids=["one_node", "stage_per_node"])
def test_only_the_stages_that_live_on_another_node_cross_it(hf_dir, tmp_path, python_env, nodes):
    """PP=2 on two ranks: on one node no weight byte crosses a node; with a stage per node, each node receives
    the other node's stage once, so the bytes crossing nodes add up to one model."""
    out = tmp_path / "out.pt"
    master = str(free_port())
    procs = []
    for rank in range(2):
        env = {**python_env, "PYTHONPATH": f"{WORKER.parent}:{python_env['PYTHONPATH']}", "RANK": str(rank),
               "WORLD_SIZE": "2", "LOCAL_RANK": str(rank if nodes == 1 else 0),
               "GROUP_RANK": str(rank * (nodes - 1)), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(hf_dir), str(out), "1", "2"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n=====\n".join(log[-3000:] for log in logs)
    res = torch.load(out)
    assert res["mean_abs_diff"] < 1e-5
    assert res["sent_rank0"] == res["bytes"]  # rank 0 fed its engine one model
    assert res["cross_node"] == (res["bytes"] if nodes == 2 else 0)


def run_sync(hf_dir, tmp_path, python_env, tp, pp):
    out = tmp_path / "out.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(tp * pp), "--master_port",
           str(free_port()), str(WORKER), str(hf_dir), str(out), str(tp), str(pp)]
    env = {**python_env, "PYTHONPATH": f"{WORKER.parent}:{python_env['PYTHONPATH']}"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-5000:]
    res = torch.load(out)
    assert res["mean_abs_diff"] < 1e-5 and res["max_abs_diff"] < 1e-4, res
    assert res["stale_mean_abs_diff"] > 1e-3  # before the sync the engine really was behind the actor
    return res



def test_a_bf16_run_syncs_two_bytes_per_parameter(base_dir, tmp_path, python_env):
    """The weights travel in the model's dtype (not float32): a bfloat16 run's sync (the trainer's own
    run state and phases) moves 2 bytes per parameter of the HF checkpoint; rank 0 feeds the embedded
    engine, nothing crosses nodes."""
    import json
    import math

    from support import SMALL

    from megatron_dapo.hf_files import hf_tensor_table
    base = base_dir
    cmd = [sys.executable, str(RUN_WORKER), "--config", str(REPO / "examples/configs/tiny_cpu.yaml"),
           f"model.hf_dir={base}", f"checkpoint.dir={tmp_path / 'ckpt'}",
           f"logging.tensorboard_dir={tmp_path / 'tb'}",
           *SMALL, "model.dtype=bfloat16"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=python_env, timeout=600)
    assert r.returncode == 0, r.stderr[-5000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    params = sum(math.prod(info.shape) for info in hf_tensor_table(base).values())  # the file's tensors
    assert out["perf/weight_sync_bytes"] == 2 * params
    assert out["perf/weight_sync_bytes_sent_rank0"] == 2 * params
    assert out["perf/weight_sync_bytes_cross_node"] == 0
