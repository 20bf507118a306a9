"""tools/bench_step.py end to end at a size that runs in seconds (one layer, a 512-token vocabulary), --compare
with two updates a step: the JSON has every field, and its figures agree with one another and with hand
arithmetic (timings are not checked); the model's matmul shapes of SmolLM2-135M against its published
parameter count."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROMPTS, G, L, STEPS = 2, 2, 8, 2


def load_tool():
    """tools/ is not a package: the module is loaded from its path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_step", REPO / "tools" / "bench_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def out() -> dict:
    cmd = [sys.executable, str(REPO / "tools" / "bench_step.py"), "--json", "--layers", "1", "--vocab", "512",
           "--prompts", str(PROMPTS), "--group-size", str(G), "--max-response-len", str(L), "--steps", str(STEPS),
           "--threads", "1", "--compare", "--mini-batches", "2"]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_fields_and_shape(out):
    for key in ("params", "matmul_params", "per_step", "summary", "peak_flop_per_s", "loadavg_before",
                "loadavg_after", "command", "overhead_s", "date"):
        assert key in out, key
    assert [r["step"] for r in out["per_step"]] == list(range(1, STEPS + 1))
    assert out["summary"]["steps_in_median"] == [2]  # the first step is left out of the median
    for row in out["per_step"]:
        for phase in ("rollout", "reward", "old_logprob", "update", "weight_sync", "step"):
            assert row[f"{phase}_s"] >= 0.0
        assert row["update_s"] > 0 and row["step_s"] >= row["rollout_s"] + row["update_s"]
        assert row["reward_s"] <= row["rollout_s"]


def test_arithmetic(out):
    n = out["matmul_params"]
    assert n == 1 * (576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536) + 576 * 512
    # tied: the parameters are the matmuls' (the output shares the embedding) plus 3 norms of 576
    assert out["params"] == n + 3 * 576
    for row in out["per_step"]:
        # every trained row is a prompt of > 8 tokens plus 1..L response tokens
        assert PROMPTS * G * 9 <= row["trained_tokens"] <= PROMPTS * G * (512 + L)
        assert row["update_tokens"] <= row["trained_tokens"]  # a shared prompt is computed once
        # the output layer computes the loss tokens only: at most the L response tokens of each row
        assert 0 < row["output_tokens"] <= PROMPTS * G * L < row["update_tokens"]
        head = 576 * 512
        assert row["update_flops"] == 6.0 * ((n - head) * row["update_tokens"] + head * row["output_tokens"])
        assert row["update_flop_per_s"] == pytest.approx(row["update_flops"] / row["update_s"])
    s = out["summary"]
    assert s["ratio"] == pytest.approx(s["update_flop_per_s"] / out["peak_flop_per_s"])
    assert out["peak_tokens"] == 1024 and out["peak_flop_per_s"] == max(out["peak_flop_per_s_before_after"])
    assert out["overhead_s"] == pytest.approx(out["train_wall_s"] - sum(r["step_s"] for r in out["per_step"]))
    assert 0 < out["cores_used"] and out["train_cpu_s"] == pytest.approx(out["cores_used"] * out["train_wall_s"])
    assert "train.prompt_batch_size=2" in out["command"] and "algo.group_size=2" in out["command"]
    assert "train.mini_batch_size=1" in out["command"]


def test_compare_runs_the_same_work_as_before_issue_28(out):
    """Before: pi_old recomputed, every row's prompt computed, so the updates compute exactly the trained
    tokens. After: pi_old taken from the embedded engine (no pass) and each group's prompt computed once."""
    before = out["before"]
    assert before["overrides"] == ["actor.shared_prefix=false", "algo.old_logprob_source=recompute",
                                   "model.local_attention=megatron"]
    assert out["overrides"] == ["algo.old_logprob_source=auto"]
    for b, a in zip(before["per_step"], out["per_step"], strict=True):
        assert a["old_logprob_s"] < b["old_logprob_s"] / 10  # no pass after: the engine's logprobs are pi_old
        assert b["prefix_saved_frac"] == 0.0
        assert abs(b["update_tokens"] - b["trained_tokens"]) <= 1  # trained_tokens is a rate x seconds, rounded
        assert 0 < b["output_tokens"] <= PROMPTS * G * L  # per row too, the output layer skips the prompt
        assert a["prefix_saved_frac"] > 0 and a["update_tokens"] < a["trained_tokens"]
    assert before["summary"]["ratio"] == pytest.approx(before["summary"]["update_flop_per_s"] / out["peak_flop_per_s"])
    assert out["step_ratio"] == pytest.approx(out["summary"]["step_s"] / before["summary"]["step_s"])


def test_smollm2_shapes_count_its_parameters():
    """SmolLM2-135M has 134,515,008 parameters (tied embeddings): the matmuls plus 61 norms of 576."""
    tool = load_tool()
    cfg = tool.model_config(30, 49152)
    assert tool.matmul_params(cfg) + 61 * 576 == 134_515_008
