"""Checkpoints a run can trust, at the checkpoint layer:

- manifest: every file's size and sha256, written before COMPLETE; a truncated, deleted or changed file
  fails verification, naming the file; `newest_verified` falls back past such checkpoints;
- a checkpoint saved before the optimizer ever stepped resumes exactly (it used to fail with
  KeyError "optimizer.state.exp_avg... from model not in state dict");
- an optimizer step that writes inf/NaN stops training, and such weights are never saved;
- no pickle of ours: trainer state is JSON, RNG states safetensors; crafted pickles are never loaded.
Multi-rank cases run tests/workers/checkpoint_worker.py under torchrun (gloo).
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import fake_checkpoint

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "workers" / "checkpoint_worker.py"


# --------------------------------------------------------------------------- manifest (no actor)


def test_manifest_lists_every_file_with_size_and_checksum(tmp_path):
    import hashlib

    from megatron_dapo.actor.checkpoint_files import verify

    path = fake_checkpoint(tmp_path, 1)
    manifest = json.loads((path / "manifest.json").read_text())["files"]
    assert set(manifest) == {"__0_0.distcp", ".metadata", "rng/rank_0.safetensors", "trainer_state.json"}
    data = (path / "__0_0.distcp").read_bytes()
    assert manifest["__0_0.distcp"] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert verify(path) is None


@pytest.mark.parametrize("damage, fragment", [
    (lambda p: (p / "__0_0.distcp").write_bytes((p / "__0_0.distcp").read_bytes()[:100]), "__0_0.distcp has 100 bytes"),
    (lambda p: (p / ".metadata").unlink(), ".metadata is missing"),
    (lambda p: (p / "rng" / "rank_0.safetensors").write_bytes(b"x" * 100), "rng/rank_0.safetensors does not match"),
    (lambda p: (p / "manifest.json").unlink(), "no manifest.json"),
    (lambda p: (p / "manifest.json").write_text("{broken"), "unreadable manifest.json"),
    (lambda p: (p / "COMPLETE").unlink(), "no COMPLETE marker"),
])
def test_a_damaged_checkpoint_fails_verification_naming_the_file(tmp_path, damage, fragment):
    from megatron_dapo.actor.checkpoint_files import verify

    path = fake_checkpoint(tmp_path, 1)
    damage(path)
    problem = verify(path)
    assert problem is not None and fragment in problem, problem


def test_newest_verified_falls_back_and_says_why(tmp_path):
    from megatron_dapo.actor.checkpoint import newest_verified

    for step in (1, 2, 3):
        fake_checkpoint(tmp_path, step)
    (tmp_path / "step_00000003" / "__0_0.distcp").write_bytes(b"")  # truncated to nothing
    (tmp_path / "step_00000004.tmp").mkdir()  # an interrupted save: not a checkpoint at all
    path, skipped = newest_verified(tmp_path)
    assert path.name == "step_00000002"
    assert [(p.name, "__0_0.distcp has 0 bytes" in why) for p, why in skipped] == [("step_00000003", True)]
    assert newest_verified(tmp_path / "nothing") == (None, [])


def test_rng_states_round_trip_without_pickle(tmp_path):
    import random

    import numpy as np

    from megatron_dapo.actor.checkpoint_files import load_rng, save_rng

    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    random.gauss(0, 1), np.random.standard_normal()  # cached gaussians are part of the state
    save_rng(tmp_path / "rng.safetensors")
    want = (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.standard_normal(),
            torch.rand(3).tolist())
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    load_rng(tmp_path / "rng.safetensors")
    got = (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.standard_normal(),
           torch.rand(3).tolist())
    assert got == want
    assert (tmp_path / "rng.safetensors").read_bytes()[:8] != b"\x80\x04\x95"  # not a pickle


def test_the_trainer_states_tensors_go_to_safetensors_beside_its_json(tmp_path):
    """Routes carried by partial rollout (and a pipeline's batches) are tensors: they leave the JSON for a safetensors
    file and come back with their dtype, shape and values."""
    from megatron_dapo.actor.checkpoint_files import STATE_FILE, TENSORS_FILE, read_state, write_state
    from megatron_dapo.collect.carry import PartialCarry
    from megatron_dapo.rollout.base import GroupRequest, SamplingParams
    from megatron_dapo.types import Prompt, Sample

    routes = torch.randint(0, 200, (5, 2, 4), dtype=torch.uint8)
    sample = Sample([1, 2, 3], [4, 5, 6], [-0.5, -0.25, -1.0], "abort", routes=routes)
    carry = PartialCarry([(Prompt("math/0", ({"role": "user", "content": "3+4"},), "7"), GroupRequest(
        key=0, prompt_ids=[1, 2, 3], n=2, sampling=SamplingParams(seed=9), resume=(sample, Sample([1, 2, 3], [], [], "abort"))))])
    write_state(tmp_path, {"step": 3, "trainer": {"carry": carry.state_dict(), "wide": torch.arange(3, dtype=torch.int16)}})
    assert (tmp_path / TENSORS_FILE).is_file() and "__tensor__" in (tmp_path / STATE_FILE).read_text()
    state = read_state(tmp_path)
    back = PartialCarry.from_state(state["trainer"]["carry"])
    got = back.groups[0][1].resume
    assert got[0].routes.dtype == torch.uint8 and torch.equal(got[0].routes, routes) and got[1].routes is None
    assert got[0].response_ids == [4, 5, 6] and back.groups[0][0].ground_truth == "7"
    assert state["trainer"]["wide"].dtype == torch.int16 and state["step"] == 3
    (tmp_path / "plain").mkdir()
    write_state(tmp_path / "plain", {"step": 1})
    assert not (tmp_path / "plain" / TENSORS_FILE).exists() and read_state(tmp_path / "plain") == {"step": 1}


def test_the_package_never_unpickles():
    """No torch.load(weights_only=False) and no pickle.load(s) anywhere in megatron_dapo/."""
    hits = []
    for path in sorted((REPO / "megatron_dapo").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            unsafe_kw = any(k.arg == "weights_only" and ast.unparse(k.value) != "True" for k in node.keywords)
            if name.endswith(("pickle.load", "pickle.loads")) or (name.endswith("torch.load") and unsafe_kw):
                hits.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert not hits, hits


def test_a_synchronous_save_starts_no_manager_process(monkeypatch):
    """megatron-core would make its write-results queue a spawned Manager's (a fresh interpreter importing the
    trainer, ~5 s of CPU per run); our synchronous saves give it an in-process queue first."""
    import queue

    import psutil
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_dapo.actor.checkpoint import _in_process_write_results

    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    _in_process_write_results()
    assert isinstance(filesystem_async._get_write_results_queue(), queue.Queue)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


# ------------------------------------------------------------------------ real actor (torchrun)


def run_case(case, hf, out, python_env, nproc=1, env=None):
    from megatron_dapo.parallel import free_port

    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), str(WORKER), case, str(hf), str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**python_env, **(env or {})}, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return [torch.load(out / f"rank_{i}.pt", weights_only=False) for i in range(nproc)]


@pytest.fixture(scope="module")
def tiny_actor_hf(tmp_path_factory):
    from megatron_dapo.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("hf"), "qwen2", vocab_size=200)


@pytest.mark.slow
def test_a_checkpoint_saved_before_any_update_resumes_exactly(tiny_actor_hf, tmp_path, python_env):
    for res in run_case("empty_opt", tiny_actor_hf, tmp_path, python_env):
        assert res["extra"]["trainer"] == {"note": "before any update"} and res["extra"]["updates"] == 0
        fresh = res["fresh"]
        for name in ("saved", "resumed"):
            assert [m["loss"] for m in res[name]["metrics"]] == [m["loss"] for m in fresh["metrics"]], name
            for key, value in fresh["params"].items():
                assert torch.equal(res[name]["params"][key], value), (name, key)
        assert fresh["metrics"][1]["update_ok"] == 1.0


def test_poisoned_weights_stop_training_and_are_never_saved(tiny_actor_hf, tmp_path, python_env):
    res = run_case("poison", tiny_actor_hf, tmp_path, python_env)[0]
    assert res["train_error"] and "inf/NaN" in res["train_error"] and "actor.optimizer.lr" in res["train_error"]
    assert res["save_error"] and "not saving" in res["save_error"]
    assert not any(name.startswith("step_") and not name.endswith(".tmp") for name in res["written"]), res["written"]


def test_checkpoints_hold_no_pickle_and_crafted_pickles_never_run(tiny_actor_hf, tmp_path, python_env):
    res = run_case("format", tiny_actor_hf, tmp_path, python_env)[0]
    ours = [f for f in res["files"] if f.endswith((".pt", ".pth", ".pkl"))]
    assert ours == ["common.pt"], res["files"]  # megatron's common state, read with weights_only=True
    assert "trainer_state.json" in res["files"] and "rng/rank_0.safetensors" in res["files"]
    assert "manifest.json" in res["files"] and "COMPLETE" in res["files"]
    assert res["extra"]["trainer"] == {"data": {"epoch": 0}} and res["extra"]["updates"] == 1
    assert res["same_params"]
    assert res["old_error"] and "older megatron-dapo" in res["old_error"] and "step_00000002" in res["old_error"]
    assert "\n" not in res["old_error"]
    assert not res["pwned"], "a crafted pickle in a checkpoint ran code"


@pytest.mark.slow
def test_a_transformer_engine_model_loads_a_local_spec_checkpoint(tiny_actor_hf, tmp_path, python_env):
    """TE's modules add `_extra_state` objects to the sharded state dict; the converter and CPU runs save
    with the local spec, without them: the strict load used to fail on them (and only on them)."""
    res = run_case("te_extra_state", tiny_actor_hf, tmp_path, python_env)[0]
    assert res["extra_keys"] > 0 and res["same_params"]
