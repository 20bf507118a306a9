"""tools/bench_rollout.py --dynamic end to end on the embedded engine, at a size that runs in seconds:
every mode keeps the same N groups per step, and each row's counts are consistent with one another."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STEPS, GROUPS, G, MAX_NEW = 2, 3, 4, 48


@pytest.fixture(scope="module")
def rows() -> dict[str, dict]:
    cmd = [sys.executable, str(REPO / "tools" / "bench_rollout.py"), "--dynamic", "--json",
           "--engines", "embedded",
           "--steps", str(STEPS), "--groups", str(GROUPS), "--group-size", str(G),
           "--max-new-tokens", str(MAX_NEW)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    out = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    modes = [(o["engine"], o["mode"]) for o in out]
    assert modes == [("embedded", m) for m in ("rounds", "streaming", "partial")], r.stdout
    return {o["mode"]: o for o in out}


@pytest.mark.parametrize("mode", ["rounds", "streaming", "partial"])
def test_each_mode_keeps_n_groups_per_step(rows, mode):
    row = rows[mode]
    assert row["kept_groups"] == STEPS * GROUPS and row["steps"] == STEPS
    kept_tokens = row["kept_response_len"] * row["kept_groups"] * G
    assert kept_tokens + row["wasted_tokens"] <= row["generated_tokens"] + 0.5 * STEPS * GROUPS * G
    assert 0.0 <= row["kept_truncated_frac"] <= 1.0 and 0 < row["kept_response_len"] <= MAX_NEW


@pytest.mark.parametrize("mode", ["rounds", "streaming", "partial"])
def test_forward_passes_are_counted(rows, mode):
    """Every pass (prefill or decode) yields a token for some live row, and a response of L tokens took at
    least L passes (its first token comes from a prefill)."""
    row = rows[mode]
    assert row["kept_response_len"] <= row["forward_passes"] <= row["generated_tokens"]
    assert row["forward_passes"] >= STEPS  # at least one pass per step


def test_partial_rollout_wastes_nothing(rows):
    assert rows["partial"]["wasted_tokens"] == 0 and rows["streaming"]["wasted_tokens"] > 0
