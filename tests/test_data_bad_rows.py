"""One bad row never rejects a dataset (a 5000-digit answer, an invalid UTF-8 byte);
it is skipped and counted, and the summary names the file and the row. `rollout.max_prompt_len` is
enforced when the prompts are loaded (counted with the tokenizer, the way the rollout renders them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from megatron_dapo.data import load_prompts
from megatron_dapo.data.render import render_prompt_ids


def _gsm8k_lines(n: int) -> list[bytes]:
    return [json.dumps({"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}).encode()
            for i in range(n)]


def test_a_5000_digit_answer_is_one_skipped_row(tmp_path: Path):
    lines = _gsm8k_lines(4)
    lines[2] = json.dumps({"question": "Huge?", "answer": "#### " + "7" * 5000}).encode()
    path = tmp_path / "gsm8k.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    result = load_prompts(str(path))
    assert [p.uid for p in result.prompts] == ["gsm8k/0", "gsm8k/1", "gsm8k/3"]
    assert result.num_skipped == 1
    summary = result.summary()
    assert str(path) in summary and "gsm8k/2" in summary, summary


def test_a_5000_digit_ground_truth_in_dapo_format(tmp_path: Path):
    rows: list[dict[str, Any]] = [
        {"prompt": [{"role": "user", "content": f"q{i}"}], "reward_model": {"ground_truth": str(i)},
         "data_source": "math_dapo"} for i in range(3)]
    rows[0]["reward_model"]["ground_truth"] = "9" * 5000
    path = tmp_path / "dapo.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    result = load_prompts(str(path))
    assert [p.uid for p in result.prompts] == ["math_dapo/1", "math_dapo/2"]
    assert result.num_skipped == 1 and "math_dapo/0" in result.summary()


def test_an_invalid_utf8_byte_is_one_skipped_row(tmp_path: Path):
    lines = _gsm8k_lines(5)
    lines[3] = lines[3].replace(b"What", b"Wh\xff\xfeat")
    path = tmp_path / "gsm8k.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    result = load_prompts(str(path))
    assert [p.uid for p in result.prompts] == ["gsm8k/0", "gsm8k/1", "gsm8k/2", "gsm8k/4"]
    assert result.num_skipped == 1
    summary = result.summary()
    assert str(path) in summary and "line 4" in summary, summary


class CharTokenizer:
    """One token per character; no chat template (rendering = the concatenated contents)."""

    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 256 for c in text]


def test_max_prompt_tokens_skips_longer_prompts(tmp_path: Path):
    lines = [json.dumps({"question": "Q" * n, "answer": "#### 1"}) for n in (10, 3000, 20)]
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("\n".join(lines) + "\n")
    tok = CharTokenizer()
    limit = len(render_prompt_ids(tok, load_prompts(str(path)).prompts[0])) + 15  # row 0 and row 2 fit
    result = load_prompts(str(path), max_prompt_tokens=limit, count_tokens=lambda p: len(render_prompt_ids(tok, p)))
    assert [p.uid for p in result.prompts] == ["gsm8k/0", "gsm8k/2"]
    assert all(len(render_prompt_ids(tok, p)) <= limit for p in result.prompts)
    assert result.num_skipped == 1 and "gsm8k/1" in result.summary()


def test_the_trainer_applies_rollout_max_prompt_len(tmp_path: Path):
    """The run's loaders pass rollout.max_prompt_len and the tokenizer: 3000-token prompts never reach the
    rollout when the limit is 32."""
    from megatron_dapo.config import load_config
    from megatron_dapo.loop.prompts import load_train_prompts, load_val_prompts

    lines = [json.dumps({"question": "Q" * n, "answer": "#### 1"}) for n in (5, 3000, 8, 3000)]
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("\n".join(lines) + "\n")
    cfg = load_config(None, [f"data.train_path={path}", f"data.val_path={path}", "rollout.max_prompt_len=400",
                             "train.prompt_batch_size=2", "train.mini_batch_size=2"])
    tok = CharTokenizer()
    train = load_train_prompts(cfg, tok)
    assert [p.uid for p in train.prompts] == ["gsm8k/0", "gsm8k/2"]
    assert [p.uid for p in load_val_prompts(cfg, tok)] == ["gsm8k/0", "gsm8k/2"]


def test_malformed_rows_name_the_fields_expected(tmp_path: Path):
    rows = [{"prompt": "q0", "reward_model": {"ground_truth": "1"}}, {"prompt": "q1", "reward_model": "1"}]
    path = tmp_path / "dapo.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    summary = load_prompts(str(path)).summary()
    assert "malformed_row=1" in summary and "ground_truth" in summary and '"question"' in summary, summary


def test_prompts_all_too_long_name_the_limit_the_length_and_the_template(tmp_path: Path):
    import pytest

    from megatron_dapo.config import load_config
    from megatron_dapo.loop.preflight import SetupError
    from megatron_dapo.loop.prompts import load_train_prompts

    path = tmp_path / "gsm8k.jsonl"
    path.write_text("\n".join(json.dumps({"question": "Q" * n, "answer": "#### 1"}) for n in (50, 70)) + "\n")
    cfg = load_config(None, [f"data.train_path={path}", "rollout.max_prompt_len=40", "data.prompt_template=gsm8k",
                                 "reward.answer_fallback=boxed"])
    rendered = load_prompts(str(path), prompt_format=_fmt("gsm8k")).prompts
    longest = len(render_prompt_ids(CharTokenizer(), rendered[1]))
    with pytest.raises(SetupError) as e:
        load_train_prompts(cfg, CharTokenizer(), _fmt("gsm8k"))
    text = str(e.value)
    for named in ("rollout.max_prompt_len=40", f"{longest} tokens", "data.prompt_template=gsm8k",
                  "data.prompt_template=raw"):
        assert named in text, (named, text)


def test_a_dataset_smaller_than_one_batch_is_refused_naming_its_size(tmp_path: Path):
    """Issue 41's "repeats prompts within a step without a word", and issue 38's refusal: the run does not start."""
    from megatron_dapo.config import load_config
    from megatron_dapo.loop.preflight import SetupError
    from megatron_dapo.loop.prompts import load_train_prompts

    path = tmp_path / "gsm8k.jsonl"
    path.write_bytes(b"\n".join(_gsm8k_lines(3)) + b"\n")
    for batch, refused in ((4, True), (3, False)):
        cfg = load_config(None, [f"data.train_path={path}", f"train.prompt_batch_size={batch}",
                                 "train.mini_batch_size=1"])
        if not refused:
            load_train_prompts(cfg, CharTokenizer())
            continue
        with pytest.raises(SetupError, match="train.prompt_batch_size=4 is larger than the 3 usable prompts"):
            load_train_prompts(cfg, CharTokenizer())


def _fmt(template):
    from megatron_dapo.data import PromptFormat

    return PromptFormat(template)
