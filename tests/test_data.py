"""Tests for megatron_dapo.data: dataset loaders, the arithmetic task and the prompt iterator."""

from __future__ import annotations

import json
import logging
import os
import re
from itertools import chain
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_dapo.data import (
    GSM8K_PROMPT_TEMPLATE,
    PromptIterator,
    arithmetic_target,
    format_arithmetic_question,
    load_prompts,
    make_arithmetic_prompts,
    normalize_integer_answer,
)

GSM8K_DIR = Path(
    os.environ.get("MEGATRON_DAPO_GSM8K_DIR")
    or Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k"
)


def _parse_answer(text: str) -> str:
    """The integer on the last "Answer:" line, like the DAPO reward parser."""
    return re.findall(r"Answer:\s*(-?\d+)", text)[-1]


# ---------------------------------------------------------------- GSM8K


@pytest.fixture
def gsm8k_test() -> Path:
    path = GSM8K_DIR / "test.jsonl"
    if not path.is_file():
        pytest.skip(f"GSM8K not found at {path}; set MEGATRON_DAPO_GSM8K_DIR")
    return path


def test_gsm8k_test_split_loads_fully(gsm8k_test: Path):
    result = load_prompts(str(gsm8k_test))
    assert len(result.prompts) == 1319 and result.skipped == {}
    assert all(re.fullmatch(r"-?\d+", p.ground_truth) for p in result.prompts)
    first = result.prompts[0]
    assert first.uid == "gsm8k/0" and first.data_source == "gsm8k"
    assert first.ground_truth == "18"  # "... 9 * 2 = $18 every day ... #### 18"
    assert len(first.messages) == 1 and first.messages[0]["role"] == "user"
    assert first.messages[0]["content"].startswith("Solve the following math problem")
    assert "Janet\u2019s ducks lay 16 eggs per day." in first.messages[0]["content"]
    assert first.messages[0]["content"].endswith(GSM8K_PROMPT_TEMPLATE.rsplit("}", 1)[1])
    by_uid = {p.uid: p for p in result.prompts}
    assert by_uid["gsm8k/146"].ground_truth == "2125"  # "#### 2,125"
    assert by_uid["gsm8k/489"].ground_truth == "-10"


def test_gsm8k_limit_and_max_chars(gsm8k_test: Path):
    assert [p.uid for p in load_prompts(str(gsm8k_test), limit=3).prompts] == [
        "gsm8k/0",
        "gsm8k/1",
        "gsm8k/2",
    ]
    result = load_prompts(str(gsm8k_test), max_prompt_chars=500)
    assert 0 < len(result.prompts) < 1319
    assert result.skipped == {"prompt_too_long": 1319 - len(result.prompts)}


# ---------------------------------------------------------------- DAPO-Math-17K format


def _dapo_row(problem: str, truth: object, index: int) -> dict:
    return {
        "data_source": "math_dapo",
        "prompt": [{"content": problem, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": truth, "style": "rule"},
        "extra_info": {"index": f"idx-{index}"},
    }


def _dapo_rows() -> list[dict]:
    rows = [_dapo_row(f"Problem {i}: what is {i}+{i}?", str(2 * i), i) for i in range(6)]
    rows[1]["reward_model"]["ground_truth"] = "\\frac{1}{2}"
    rows[3]["prompt"] = [{"content": "x" * 5000, "role": "user"}]
    rows[4]["reward_model"]["ground_truth"] = "1,000"
    return rows


def test_dapo_jsonl_bad_rows_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    rows = _dapo_rows()
    lines = [json.dumps(r) for r in rows]
    lines.insert(2, '{"prompt": [broken')
    missing_rm = dict(rows[0])
    del missing_rm["reward_model"]
    lines.append(json.dumps(missing_rm))
    path = tmp_path / "dapo.jsonl"
    path.write_text("\n".join(lines) + "\n")

    with caplog.at_level(logging.WARNING):
        result = load_prompts(str(path), max_prompt_chars=1000)
    # line index: 0 ok, 1 frac, 2 broken, 3 ok(row 2), 4 too long(row 3), 5 "1,000", 6 ok, 7 no reward_model
    assert [p.uid for p in result.prompts] == ["math_dapo/0", "math_dapo/3", "math_dapo/5", "math_dapo/6"]
    assert [p.ground_truth for p in result.prompts] == ["0", "4", "1000", "10"]
    assert result.skipped == {
        "non_integer_answer": 1,
        "bad_json": 1,
        "prompt_too_long": 1,
        "malformed_row": 1,
    }
    assert result.examples["bad_json"] == ["line 3"]
    assert result.examples["non_integer_answer"] == ["math_dapo/1"]
    assert result.examples["prompt_too_long"] == ["math_dapo/4"]
    assert "skipped 4" in result.summary() and "bad_json=1" in result.summary()
    assert any("skipped" in r.message for r in caplog.records)
    assert load_prompts(str(path), max_prompt_chars=1000).prompts == result.prompts


def test_dapo_parquet(tmp_path: Path):
    rows = _dapo_rows()
    del rows[5]["reward_model"]
    path = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    result = load_prompts(str(path), max_prompt_chars=1000)
    assert [p.uid for p in result.prompts] == ["math_dapo/0", "math_dapo/2", "math_dapo/4"]
    assert [p.ground_truth for p in result.prompts] == ["0", "4", "1000"]
    assert result.prompts[0].messages == ({"role": "user", "content": "Problem 0: what is 0+0?"},)
    assert result.skipped == {"non_integer_answer": 1, "prompt_too_long": 1, "malformed_row": 1}
    assert len(load_prompts(str(path), limit=2).prompts) == 2


def test_numpy_array_prompt(tmp_path: Path):
    np = pytest.importorskip("numpy")
    from megatron_dapo.data.datasets import _dapo_prompt

    row = _dapo_row("hi", "7", 0)
    row["prompt"] = np.array(row["prompt"], dtype=object)
    prompt = _dapo_prompt(row, 9, "x")
    assert prompt.uid == "math_dapo/9" and prompt.messages == ({"role": "user", "content": "hi"},)


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("34", "34"),
        (" 1,000 ", "1000"),
        ("+5", "5"),
        ("007", "7"),
        ("-3", "-3"),
        ("12.0", "12"),
        (42, "42"),
        ("\\frac{1}{2}", None),
        ("12.5", None),
        ("1,00", None),
        ("2+3", None),
        ("", None),
        (True, None),
        (1.5, None),
    ],
)
def test_normalize_integer_answer(raw, expected):
    assert normalize_integer_answer(raw) == expected


def test_load_errors(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompts(str(tmp_path / "nope.jsonl"))
    csv = tmp_path / "data.csv"
    csv.write_text("a,b\n")
    with pytest.raises(ValueError, match="data.csv"):
        load_prompts(str(csv))
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"text": "hello"}\n')
    with pytest.raises(ValueError, match="odd.jsonl"):
        load_prompts(str(odd))
    with pytest.raises(ValueError, match="unknown builtin"):
        load_prompts("builtin:nothing")
    with pytest.raises(ValueError, match="bad builtin:arithmetic option"):
        load_prompts("builtin:arithmetic?size=3")


# ---------------------------------------------------------------- arithmetic


def test_arithmetic_deterministic_and_correct():
    a = make_arithmetic_prompts(200, seed=0)
    assert a == make_arithmetic_prompts(200, seed=0)
    assert [p.messages for p in a] != [p.messages for p in make_arithmetic_prompts(200, seed=1)]
    assert make_arithmetic_prompts(20, seed=0) == a[:20]
    for p in a:
        content = p.messages[0]["content"]
        assert re.fullmatch(r"\d{1,2}[+\-*]\d{1,2}=", content) and p.data_source == "arithmetic"
        assert int(p.ground_truth) == eval(content[:-1])
        assert _parse_answer(arithmetic_target(p)) == p.ground_truth
    assert {p.messages[0]["content"][-2] for p in a} <= set("0123456789")
    assert format_arithmetic_question(12, "+", 7) == "12+7="


def test_arithmetic_spec_string():
    spec = load_prompts("builtin:arithmetic?n=50&seed=3&max_digits=3&ops=+-")
    assert spec.prompts == make_arithmetic_prompts(50, 3, max_digits=3, ops=("+", "-"))
    assert all("*" not in p.messages[0]["content"] for p in spec.prompts)
    assert len(load_prompts("builtin:arithmetic").prompts) == 1000
    with pytest.raises(ValueError):
        make_arithmetic_prompts(3, 0, ops=("/",))


# ---------------------------------------------------------------- iterator


def _uids(batches) -> list[list[str]]:
    return [[p.uid for p in b] for b in batches]


def _flat(batches: list[list[str]]) -> list[str]:
    return list(chain.from_iterable(batches))


@pytest.fixture
def prompts():
    return make_arithmetic_prompts(23, seed=0)


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("k", [0, 3, 4, 5, 9])
def test_iterator_resume(prompts, k: int, drop_last: bool):
    ref = PromptIterator(prompts, 5, seed=7, drop_last=drop_last)
    expected = _uids(ref.next_batch() for _ in range(15))
    it = PromptIterator(prompts, 5, seed=7, drop_last=drop_last)
    for _ in range(k):
        next(it)
    state = json.loads(json.dumps(it.state_dict()))
    resumed = PromptIterator(prompts, 5, seed=0, drop_last=drop_last)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == it.state_dict()
    assert _uids(next(resumed) for _ in range(15 - k)) == expected[k:]


def test_iterator_epochs(prompts):
    it = PromptIterator(prompts, 5, seed=1)
    assert it.batches_per_epoch == 4
    epoch0 = _uids(next(it) for _ in range(4))
    assert it.epoch == 1 and it.state_dict() == {"epoch": 1, "position": 0, "seed": 1, "num_prompts": 23}
    epoch1 = _uids(next(it) for _ in range(4))
    assert len(set(_flat(epoch0))) == 20 and epoch0 != epoch1
    padded = PromptIterator(prompts, 5, seed=1, drop_last=False)
    epoch = _flat(_uids(next(padded) for _ in range(padded.batches_per_epoch)))
    assert len(epoch) == 25 and set(epoch) == {p.uid for p in prompts} and epoch[23:] == epoch[:2]
    ordered = PromptIterator(prompts, 5, seed=1, shuffle=False)
    assert _uids([next(ordered)]) == [[f"arithmetic/{i}" for i in range(5)]]


def test_iterator_invalid(prompts):
    with pytest.raises(ValueError):
        PromptIterator(prompts, 0, seed=0)
    with pytest.raises(ValueError):
        PromptIterator(prompts, 24, seed=0)
    with pytest.raises(ValueError):
        PromptIterator([], 1, seed=0)
    it = PromptIterator(prompts, 4, seed=0)
    with pytest.raises(ValueError, match="dataset changed"):
        it.load_state_dict({"epoch": 0, "position": 0, "seed": 0, "num_prompts": 99})
    with pytest.raises(ValueError, match="missing"):
        it.load_state_dict({"epoch": 0})
