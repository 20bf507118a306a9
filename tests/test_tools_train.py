"""The trainer with rollout.tools on the tiny base: two steps and an evaluation of multi-turn rollouts through
the real sandbox, the tool monitors written, the observations in the sampled responses. The tiny base was
never taught a code fence, so the fences here are ones it writes by chance ("Answer: " opens a block, a "2"
closes it): the calls are real, their code mostly not valid Python (tool/error_frac)."""

from __future__ import annotations

import json
import math

import pytest

from megatron_dapo.metrics import read_scalars
from megatron_dapo.rollout.tools import monitors
from megatron_dapo.sandbox import SandboxConfig, SandboxUnavailable, check_sandbox
from support import TOOL_TAGS, run_train, train_cmd

TOOLS = ["rollout.streaming=false", "rollout.tools.name=python", "rollout.tools.code_open=Answer: ",
         "rollout.tools.code_close=2", "rollout.tools.max_output_tokens=4", "algo.void_turn_filter=true"]


def test_two_steps_with_tool_calls(base_dir, tmp_path, python_env):
    try:
        check_sandbox(SandboxConfig())
    except SandboxUnavailable as e:
        pytest.skip(str(e))
    run_train(train_cmd(base_dir, tmp_path, "tools", "train.steps=2", "checkpoint.save_every=0", "eval.max_prompts=4",
                        "checkpoint.export_hf=false", "logging.samples_every=1", *TOOLS), python_env)
    tb = read_scalars(tmp_path / "tb" / "tools")
    assert sorted(monitors.TOOL_TAGS) == sorted(TOOL_TAGS)
    for tag in TOOL_TAGS:
        assert set(tb[tag]) == {1, 2} and all(math.isfinite(v) for v in tb[tag].values()), tag
    assert sum(tb["tool/calls_per_sample"].values()) > 0 and min(tb["rollout/turns_mean"].values()) >= 1
    assert 0 <= tb["rollout/observation_token_frac"][1] < 1 and "actor/pg_loss" in tb
    rows = [json.loads(line) for f in (tmp_path / "tb" / "tools" / "samples").glob("*.jsonl")
            for line in f.read_text().splitlines()]
    assert any("```output" in r["response"] for r in rows if r["split"] == "train")
    assert {r["split"] for r in rows} == {"train", "val"}  # the evaluation streams multi-turn groups too
