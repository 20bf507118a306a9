"""tools/bench_generate.py end to end on a tiny chat model (seconds): the recipe's prompts rendered with the
model's template, every response at the limit, both modes, before (top-p by a full sort) and after, in one
process; its figures agree with one another and with hand
arithmetic (timings are not checked, only that the profile saw each part)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dapo.tiny.chat import save_chat_model

REPO = Path(__file__).resolve().parents[1]
PROMPTS, N, NEW = 3, 2, 5


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_chat_model(tmp_path_factory.mktemp("chat") / "m", "llama", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def test_the_json_adds_up(model):
    cmd = [sys.executable, str(REPO / "tools" / "bench_generate.py"), "--hf-dir", str(model), "--json",
           "--prompts", str(PROMPTS), "--n", str(N), "--new-tokens", str(NEW), "--threads", "1", "--repeats", "1",
           "--modes", "stream", "generate", "--compare", "--top-p", "0.9"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    outs = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert [o["mode"] for o in outs] == ["stream_before", "generate_before", "stream_after", "generate_after"]
    cfg = json.loads((model / "config.json").read_text())
    h, i, v, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    params = layers * (2 * h * h + 2 * h * kv + 3 * h * i) + h * v  # q, o, k, v, gate, up, down; the output layer
    for out in outs:
        assert out["generated_tokens"] == PROMPTS * N * NEW and out["prompts"] == PROMPTS
        assert out["bound_tokens_per_s"] == pytest.approx(out[f"peak_flop_per_s_{PROMPTS * N}_rows"] / (2 * params))
        assert out["ratio_to_bound"] == pytest.approx(out["tokens_per_s"] / out["bound_tokens_per_s"])
        assert out["tokens_per_s"] == pytest.approx(out["generated_tokens"] / out["seconds"])
        assert out["prompt_tokens_prefilled"] > PROMPTS * 10  # the recipe's few-shot turns, in the chat template
        assert set(out["profile_s"]) == {"prefill", "decode_forward", "sampling"}
        assert 0 < sum(out["profile_s"].values()) <= out["seconds"]
