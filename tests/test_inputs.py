"""Impossible runs are refused before anything loads, by `--dry-run` and by the run itself (loop/inputs.py):
a missing model folder or tokenizer, a missing, unreadable or unusable dataset, a batch larger than the
dataset, a rollout budget that cannot hold one batch, a max_prompt_len that every prompt exceeds. Each is one
line naming the setting and the number that would fit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import one_line, run, train_cmd

from megatron_dapo.config import load_config
from megatron_dapo.data import load_prompts
from megatron_dapo.data.render import render_prompt_ids
from megatron_dapo.loop.inputs import SAMPLE, check_inputs
from megatron_dapo.loop.preflight import SetupError

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "examples/configs/tiny_cpu.yaml")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A tiny Qwen2 folder with the character tokenizer (one token per character)."""
    from megatron_dapo.tiny import save_tiny_model
    from megatron_dapo.tiny.tokenizer import build_char_tokenizer, save_tokenizer

    path = save_tiny_model(tmp_path_factory.mktemp("model") / "m", "qwen2")
    save_tokenizer(build_char_tokenizer(), path)
    return path


def gsm8k(path: Path, question_lengths: list[int]) -> Path:
    path.write_text("".join(json.dumps({"question": "Q" * n, "answer": "#### 1"}) + "\n" for n in question_lengths))
    return path


def refused(model: Path, *overrides: str) -> str:
    cfg = load_config(TINY, [f"model.hf_dir={model}", *overrides])
    with pytest.raises(SetupError) as e:
        check_inputs(cfg)
    return str(e.value)


def test_a_possible_run_passes(model):
    tokenizer, _ = check_inputs(load_config(TINY, [f"model.hf_dir={model}"]))
    assert tokenizer.encode("12") == tokenizer.encode("1") + tokenizer.encode("2")


def test_a_missing_model_folder_or_tokenizer(model, tmp_path):
    assert "has no config.json" in refused(tmp_path / "nope")
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        (bare / f).symlink_to(model / f)
    assert "no tokenizer files" in refused(bare)


def test_a_missing_or_unreadable_dataset(model, tmp_path):
    assert "data.train_path=/nowhere/x.jsonl: no such file" in refused(model, "data.train_path=/nowhere/x.jsonl")
    (tmp_path / "dir.jsonl").mkdir()
    assert "cannot read it (Is a directory)" in refused(model, f"data.train_path={tmp_path / 'dir.jsonl'}")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all" * 10)
    assert "not a readable parquet file" in refused(model, f"data.train_path={tmp_path / 'bad.parquet'}")
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00\x01\n" * 10)
    line = refused(model, f"data.train_path={tmp_path / 'binary.jsonl'}")
    assert "no usable prompt" in line and "bad_encoding=10" in line, line
    assert "data.val_path=/nowhere/v.jsonl: no such file" in refused(model, "data.val_path=/nowhere/v.jsonl")


def test_a_batch_larger_than_the_dataset(model, tmp_path):
    line = refused(model, "data.train_path=builtin:arithmetic?n=50&seed=0", "train.prompt_batch_size=100000000")
    assert "train.prompt_batch_size=100000000 is larger than" in line and "which has 50 prompts" in line, line
    # counted from the parquet footer: more rows than the sample reads
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": [{"role": "user", "content": f"{i} + 1 = ?"}], "reward_model": {"ground_truth": str(i + 1)},
             "data_source": "t"} for i in range(SAMPLE + 88)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    line = refused(model, f"data.train_path={tmp_path / 'd.parquet'}", f"train.prompt_batch_size={SAMPLE + 89}",
                   "train.mini_batch_size=1")
    assert f"which has {SAMPLE + 88} prompts: lower it to at most {SAMPLE + 88}" in line, line
    check_inputs(load_config(TINY, [f"model.hf_dir={model}", f"data.train_path={tmp_path / 'd.parquet'}",
                                    f"train.prompt_batch_size={SAMPLE + 88}", "train.mini_batch_size=1",
                                    "rollout.max_prompt_len=64"]))


def test_a_budget_that_cannot_hold_one_batch(model):
    line = refused(model, "train.prompt_batch_size=64", "algo.group_size=8", "train.rollout_budget=500")
    assert "train.rollout_budget=500 responses cannot hold one batch" in line and "= 512 responses" in line, line
    assert "the budget holds 62 prompts; data.train_path has 4000" in line, line
    check_inputs(load_config(TINY, [f"model.hf_dir={model}", "train.prompt_batch_size=64", "algo.group_size=8",
                                    "train.rollout_budget=512"]))


def test_a_max_prompt_len_every_prompt_exceeds(model, tmp_path):
    from megatron_dapo.loop.preflight import load_tokenizer

    path, one = gsm8k(tmp_path / "g.jsonl", [40, 30, 50]), "train.mini_batch_size=1"
    tokenizer = load_tokenizer(str(model))  # the rendering is the rollout's: the model's tokenizer, loaded
    shortest = min(len(render_prompt_ids(tokenizer, p)) for p in load_prompts(str(path)).prompts)
    line = refused(model, f"data.train_path={path}", "train.prompt_batch_size=2", one,
                   f"rollout.max_prompt_len={shortest - 1}")
    assert f"rollout.max_prompt_len={shortest - 1} tokens: every one of its 3 usable prompts is longer" in line, line
    assert f"raise it to at least {shortest}" in line, line
    # one prompt fits: too few for the batch, and the line says how many do
    line = refused(model, f"data.train_path={path}", "train.prompt_batch_size=2", one,
                   f"rollout.max_prompt_len={shortest}")
    assert "train.prompt_batch_size=2 is larger than the 1 usable prompts" in line, line
    check_inputs(load_config(TINY, [f"model.hf_dir={model}", f"data.train_path={path}", "train.prompt_batch_size=1",
                                    one, f"rollout.max_prompt_len={shortest}"]))


def test_dry_run_refuses_what_the_run_would(model, python_env):
    """Today's `--dry-run` passed a batch of 1e8 prompts (the run then grew until memory ran out)."""
    r = subprocess.run([sys.executable, "-m", "megatron_dapo.train", "--config", TINY, "--dry-run",
                        f"model.hf_dir={model}", "train.prompt_batch_size=100000000"],
                       capture_output=True, text=True, env=python_env, timeout=300)
    one_line(r, 2, "train: error: train.prompt_batch_size=100000000 is larger than", "which has 4000 prompts")
    assert r.stdout == ""


def test_the_run_refuses_before_anything_loads(model, tmp_path, env):
    """A missing dataset used to be found after the model, the engine and the run folder were set up."""
    r = run(train_cmd(model, tmp_path, "nodata", "data.train_path=/nowhere/train.jsonl"), env, timeout=300)
    one_line(r, 2, "data.train_path=/nowhere/train.jsonl: no such file")
    assert not (tmp_path / "ckpt" / "nodata").exists()  # not even the run folder
