"""tools/bench_rollout.py --dynamic end to end on the embedded engine, at a size that runs in seconds:
every mode of every workload in the sweep keeps the same N groups per step, and each row's counts are
consistent with one another; the forward-pass and prefill counter against hand arithmetic."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dapo.benchmark import ForwardCounter
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.embedded import EmbeddedEngine
from megatron_dapo.tiny import tiny_model

REPO = Path(__file__).resolve().parents[1]
STEPS, GROUPS, G, MAX_NEW = 2, 3, 4, 48
FRACS = (0.1, 0.5)
MODES = ("rounds", "streaming", "partial")
CASES = [(f, m) for f in FRACS for m in MODES]


def run_bench(*extra: str) -> dict:
    cmd = [sys.executable, str(REPO / "tools" / "bench_rollout.py"), "--dynamic", "--json",
           "--engines", "embedded",
           "--steps", str(STEPS), "--groups", str(GROUPS), "--group-size", str(G),
           "--max-new-tokens", str(MAX_NEW), "--ramble-frac", ",".join(map(str, FRACS)), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    out = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    cases = [(o["engine"], o["workload"], o["ramble_frac"], o["mode"]) for o in out]
    assert cases == [("embedded", "ramble", f, m) for f, m in CASES], r.stdout
    return {(o["ramble_frac"], o["mode"]): o for o in out}


@pytest.fixture(scope="module")
def rows() -> dict:
    return run_bench()


@pytest.mark.parametrize("case", CASES)
def test_each_mode_keeps_n_groups_per_step(rows, case):
    row = rows[case]
    assert row["kept_groups"] == STEPS * GROUPS and row["steps"] == STEPS
    kept_tokens = row["kept_response_len"] * row["kept_groups"] * G
    assert kept_tokens + row["wasted_tokens"] <= row["generated_tokens"] + 0.5 * STEPS * GROUPS * G
    assert 0.0 <= row["kept_truncated_frac"] <= 1.0 and 0 < row["kept_response_len"] <= MAX_NEW


@pytest.mark.parametrize("case", CASES)
def test_forward_passes_are_counted(rows, case):
    """Every pass (prefill or decode) yields a token for some live row, and a response of L tokens took at
    least L passes (its first token comes from a prefill). Every kept group's prompt (>= 8 tokens) was
    prefilled at least once."""
    row = rows[case]
    assert row["kept_response_len"] <= row["forward_passes"] <= row["generated_tokens"]
    assert row["forward_passes"] >= STEPS  # at least one pass per step
    assert row["prefill_tokens"] >= 8 * row["kept_groups"]


@pytest.mark.parametrize("frac", FRACS)
def test_partial_rollout_wastes_nothing(rows, frac):
    assert rows[frac, "partial"]["wasted_tokens"] == 0 and rows[frac, "streaming"]["wasted_tokens"] > 0


def test_more_ramblers_cost_more_tokens(rows):
    assert rows[0.5, "rounds"]["generated_tokens"] > rows[0.1, "rounds"]["generated_tokens"]


def test_forward_counter_by_hand():
    """Two prompts (5 and 7 tokens) x 3 samples x 4 new tokens, EOS ignored: one left-padded prefill of
    2 x 7 positions, then 3 decode passes."""
    model = tiny_model("qwen2", seed=0, vocab_size=64, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    engine = EmbeddedEngine(model)
    counter = ForwardCounter(engine)
    sampling = SamplingParams(max_new_tokens=4, ignore_eos=True, seed=0)
    with counter.counting():
        engine.generate([list(range(2, 7)), list(range(2, 9))], 3, sampling)
    assert counter.counts() == (4, 14)
    engine.generate([[3, 4]], 1, sampling)  # outside counting(): not counted
    assert counter.counts() == (4, 14)


def test_device_moves_the_embedded_engine_only():
    cmd = [sys.executable, str(REPO / "tools" / "bench_rollout.py"), "--dynamic", "--device", "cuda"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode != 0 and "pass --engines embedded" in r.stderr


@pytest.mark.gpu
def test_the_benchmark_runs_on_cuda():
    """The GPU check's rounds-vs-streaming stage (tools/gpu_check.sh): the same sweep on the CUDA engine."""
    on_gpu = run_bench("--device", "cuda")
    for case, row in on_gpu.items():
        assert row["kept_groups"] == STEPS * GROUPS and row["forward_passes"] >= STEPS, case
