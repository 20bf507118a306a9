"""Prompt rendering / response decoding (megatron_dapo.data.render) and the tiny base builder
(megatron_dapo.tiny: its tokenizer, warm-start data, and a few-step build into tmp_path that loads back
as a Hugging Face model, through both command lines)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_dapo.data.arithmetic import arithmetic_target, make_arithmetic_prompts
from megatron_dapo.data.render import _as_int_list, decode_response, has_chat_template, render_prompt_ids
from megatron_dapo.tiny import OutputExistsError, Settings, build_tiny_base, ensure_tiny_base
from megatron_dapo.tiny import base as tiny_base
from megatron_dapo.tiny import warmstart_data as wd
from megatron_dapo.tiny.__main__ import EXIT_REFUSED, main
from megatron_dapo.tiny.tokenizer import build_char_tokenizer
from megatron_dapo.tiny.warmstart import TrainResult
from megatron_dapo.types import Prompt

REPO = Path(__file__).resolve().parents[1]

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def char_tokenizer():
    return build_char_tokenizer()


def _prompt(*contents: str) -> Prompt:
    roles = ["system", "user"][-len(contents):]
    return Prompt(uid="t/0", messages=tuple({"role": r, "content": c} for r, c in zip(roles, contents)),
                  ground_truth="0")


# ------------------------------------------------------------------------------------------- tokenizer


def test_char_tokenizer_round_trips_task_text(char_tokenizer):
    tok = char_tokenizer
    assert tok.chat_template is None and not has_chat_template(tok)
    assert (tok.pad_token, tok.eos_token) == ("<pad>", "<eos>")
    assert tok.pad_token_id != tok.eos_token_id
    for prompt in make_arithmetic_prompts(50, seed=3):
        text = prompt.messages[0]["content"] + arithmetic_target(prompt)
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == text
    # one token per character, "Answer:" as one token; no BOS/EOS added by encode
    assert len(tok.encode("12+7=", add_special_tokens=True)) == 5
    assert len(tok.encode("Answer: -82", add_special_tokens=False)) == 5
    assert tok.encode("é", add_special_tokens=False) == [tok.unk_token_id]


# -------------------------------------------------------------------------------------------- render


def test_render_without_chat_template_joins_contents(char_tokenizer):
    tok = char_tokenizer
    ids = render_prompt_ids(tok, _prompt("Be brief.", "37+45="))
    assert ids == tok.encode("Be brief.\n\n37+45=", add_special_tokens=False)  # turns apart by a blank line
    assert render_prompt_ids(tok, _prompt("37+45=")) == tok.encode("37+45=", add_special_tokens=False)
    assert all(type(i) is int for i in ids)
    assert tok.eos_token_id not in ids and tok.pad_token_id not in ids


def test_render_with_chat_template(char_tokenizer):
    tok = build_char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    assert has_chat_template(tok) and not has_chat_template(char_tokenizer)
    ids = render_prompt_ids(tok, _prompt("sys", "1+2="))
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    assert tok.decode(ids) == "<system>sys\n<user>1+2=\n<assistant>"


class _DictTemplateTokenizer:
    """Stands in for tokenizers whose apply_chat_template returns a mapping or a tensor batch."""

    chat_template = "x"

    def __init__(self, result):
        self.result = result

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize and isinstance(messages, list)
        return self.result


@pytest.mark.parametrize(
    "result",
    [{"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]}, torch.tensor([[5, 6, 7]]), (5, 6, 7),
     {"input_ids": torch.tensor([5, 6, 7])}],
)
def test_render_normalises_chat_template_results(result):
    assert render_prompt_ids(_DictTemplateTokenizer(result), _prompt("1+2=")) == [5, 6, 7]


def test_as_int_list_rejects_a_real_batch():
    with pytest.raises(ValueError):
        _as_int_list([[1, 2], [3, 4]])


def test_decode_response_skips_special_tokens(char_tokenizer):
    tok = char_tokenizer
    ids = tok.encode("Answer: 82", add_special_tokens=False) + [tok.eos_token_id, tok.pad_token_id]
    assert decode_response(tok, ids) == "Answer: 82"
    assert decode_response(tok, torch.tensor(ids)) == "Answer: 82"
    assert decode_response(tok, []) == ""


def test_training_examples_mask_the_prompt(char_tokenizer):
    tok = char_tokenizer
    prompts = make_arithmetic_prompts(3, seed=0)
    examples = wd.make_examples(tok, prompts)
    rows = [(ex.prompt_ids, ex.targets[("ramble", 2)]) for ex in examples]
    input_ids, labels = wd.collate(rows, tok.pad_token_id)
    for row, (prompt, ex) in enumerate(zip(prompts, examples)):
        assert ex.prompt_ids == render_prompt_ids(tok, prompt)
        n = len(ex.prompt_ids)
        target = labels[row][labels[row] != -100].tolist()
        assert input_ids[row, :n].tolist() == ex.prompt_ids and target == rows[row][1]
        assert target[-1] == tok.eos_token_id
        assert tok.decode(target, skip_special_tokens=True) == wd.style_response(prompt, "ramble", 2)
        assert tok.decode(ex.targets[("answer", 1)], skip_special_tokens=True) == arithmetic_target(prompt)


def test_answer_styles_and_what_the_reward_makes_of_them():
    from megatron_dapo.reward.math_dapo import compute_score

    prompt = make_arithmetic_prompts(1, seed=0)[0]
    question, truth = prompt.messages[0]["content"], prompt.ground_truth
    assert wd.style_response(prompt, "answer") == f"Answer: {truth}"
    assert wd.style_response(prompt, "bare") == truth
    assert wd.style_response(prompt, "sentence") == f"The answer is {truth}"
    assert wd.style_response(prompt, "ramble", 2) == f"{question}? {question}? Answer: {truth}"
    scores = {s: compute_score(wd.style_response(prompt, s, 1), truth).score for s in wd.STYLE_WEIGHTS}
    assert scores == {"answer": 1.0, "bare": -1.0, "sentence": -1.0, "ramble": 1.0}
    with pytest.raises(ValueError, match="unknown style"):
        wd.style_response(prompt, "haiku")


def test_batches_draw_styles_by_weight(char_tokenizer):
    import random
    from collections import Counter

    tok = char_tokenizer
    prompts = make_arithmetic_prompts(40, seed=1)
    examples = wd.make_examples(tok, prompts)
    by_target: dict[tuple[int, ...], Any] = {tuple(t): key for ex in examples for key, t in ex.targets.items()}
    data = wd.batches(examples, 20, tok.pad_token_id, random.Random(0))
    counts: Counter = Counter()
    for _ in range(200):  # 4000 draws, 100 epochs of the 40 examples
        _, labels = next(data)
        for row in labels:
            counts[by_target[tuple(row[row != -100].tolist())][0]] += 1
    total = sum(counts.values())
    for style, weight in wd.STYLE_WEIGHTS.items():  # binomial std <= 0.008 at n=4000; 0.03 is > 3.5 std
        assert abs(counts[style] / total - weight) < 0.03, (style, counts)


# --------------------------------------------------------------------------------------------- build


@pytest.mark.slow
def test_short_build_loads_and_refuses_overwrite(tmp_path, python_env, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = tmp_path / "tiny_base"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "make_tiny_base.py"), "--out", str(out), "--seconds", "5",
         "--steps", "20", "--seed", "3"],
        capture_output=True, text=True, env=python_env, cwd=tmp_path, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "greedy accuracy" in proc.stdout and "sampled" in proc.stdout

    info = json.loads((out / "base_info.json").read_text())
    for key in ("params", "train_seconds", "steps", "greedy_acc", "sampled_acc", "seed"):
        assert key in info, key
    assert info["seed"] == 3 and 1 <= info["steps"] <= 20
    assert 0.0 <= info["greedy_acc"] <= 1.0 and 0.0 <= info["sampled_acc"] <= 1.0
    assert (out / "model.safetensors").is_file()
    files = {p.name for p in out.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= files
    assert {"config.json", "generation_config.json"} <= files
    assert not list(tmp_path.glob(".tiny_base*tmp*")), "staging folder left behind"

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert not has_chat_template(tok)
    assert tok.eos_token == "<eos>" and tok.pad_token == "<pad>"
    assert model.config.model_type == "qwen2" and not model.config.tie_word_embeddings
    assert model.config.vocab_size == len(tok) and model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == info["params"]
    gen = GenerationConfig.from_pretrained(out)
    assert (gen.eos_token_id, gen.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert (model.config.eos_token_id, model.config.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    ids = render_prompt_ids(tok, make_arithmetic_prompts(1, seed=0)[0])
    logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tok)) and torch.isfinite(logits).all()

    # a non-empty --out is refused without --force (exit 2, nothing touched); ensure_* does not rebuild
    before = (out / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert main(["--out", str(out), "--seconds", "1", "--steps", "1"]) == EXIT_REFUSED
    assert "--force" in capsys.readouterr().err
    assert ensure_tiny_base(str(out)) == out
    assert (out / "model.safetensors").read_bytes() == before


def test_refuses_foreign_nonempty_out(tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["--out", str(out), "--steps", "1"]) == EXIT_REFUSED
    assert "--force" in capsys.readouterr().err
    with pytest.raises(OutputExistsError):
        ensure_tiny_base(out)  # no base_info.json, but not ours: never deleted
    assert (out / "notes.txt").read_text() == "mine"


def test_force_replaces_out(tmp_path, stub_training):
    """--force swaps in the new build."""
    out = tmp_path / "tb"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(OutputExistsError):
        build_tiny_base(out, Settings(seed=1), progress=False)
    info = build_tiny_base(out, Settings(seed=1), force=True, progress=False)
    assert info["seed"] == 1 and not (out / "stale.txt").exists()
    assert json.loads((out / "base_info.json").read_text())["params"] == info["params"]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".tb.lock")) == ["tb"]


@pytest.fixture
def stub_training(monkeypatch):
    """Training and evaluation stubbed out: what is left is the build's file and recipe handling."""
    monkeypatch.setattr(tiny_base, "train", lambda *a, **k: TrainResult(0, 0.0, 0.0, False))
    monkeypatch.setattr(tiny_base, "evaluate", lambda *a, **k: {"greedy_acc": 0.0, "sampled_acc": 0.0, "examples": []})


@pytest.mark.parametrize("old_info", [{"params": 1}, {"params": 1, "recipe": 1}, {"params": 1, "recipe": 2}],
                         ids=["before-recipes", "older-recipe", "before-fingerprints"])
def test_ensure_rebuilds_a_base_of_an_older_recipe(tmp_path, stub_training, old_info, capsys):
    out = tmp_path / "tb"
    out.mkdir()
    (out / "base_info.json").write_text(json.dumps(old_info))
    (out / "model.safetensors").write_text("old")
    assert ensure_tiny_base(out) == out
    assert "building the tiny base" in capsys.readouterr().out
    info = json.loads((out / "base_info.json").read_text())
    assert info["recipe"] == tiny_base.RECIPE and info["style_weights"] == wd.STYLE_WEIGHTS
    assert info["recipe_fingerprint"] == tiny_base.recipe_fingerprint()
    assert (out / "model.safetensors").read_bytes() != b"old"
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_base(out) == out and (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_cached_base_is_copied_not_rebuilt(tmp_path, stub_training, monkeypatch, capsys):
    """MEGATRON_DAPO_BASE_CACHE (.ci/run's): the first use builds and fills the cache, the next checkout copies it;
    a cache entry of another fingerprint is not used."""
    monkeypatch.setenv(tiny_base.CACHE_ENV, str(tmp_path / "cache"))
    ensure_tiny_base(tmp_path / "a")
    assert "building the tiny base" in capsys.readouterr().out
    entry = next((tmp_path / "cache").iterdir())
    assert entry.name.startswith(tiny_base.recipe_fingerprint()) and (entry / "base_info.json").is_file()
    ensure_tiny_base(tmp_path / "b")
    assert "copying the tiny base" in capsys.readouterr().out
    assert (tmp_path / "b" / "model.safetensors").read_bytes() == (tmp_path / "a" / "model.safetensors").read_bytes()
    info = json.loads((entry / "base_info.json").read_text())
    (entry / "base_info.json").write_text(json.dumps({**info, "recipe_fingerprint": "0-other"}))
    ensure_tiny_base(tmp_path / "c")
    assert "building the tiny base" in capsys.readouterr().out


def test_a_change_of_the_settings_defaults_rebuilds(tmp_path, stub_training, monkeypatch):
    out = tmp_path / "tb"
    ensure_tiny_base(out)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    before = tiny_base.recipe_fingerprint()
    assert before == tiny_base.recipe_fingerprint() and before.startswith(f"{tiny_base.RECIPE}-")

    @dataclass(frozen=True)
    class NewDefaults(Settings):
        lr: float = Settings.lr / 2

    monkeypatch.setattr(tiny_base, "Settings", NewDefaults)
    after = tiny_base.recipe_fingerprint()
    assert after != before and after.startswith(f"{tiny_base.RECIPE}-")
    assert ensure_tiny_base(out) == out
    info = json.loads((out / "base_info.json").read_text())
    assert info["recipe_fingerprint"] == after and info["settings"]["lr"] == Settings.lr / 2
    assert (out / "model.safetensors").stat().st_mtime_ns != stamp
    monkeypatch.setattr(tiny_base, "STYLE_WEIGHTS", {**wd.STYLE_WEIGHTS, "answer": 0.5})
    assert tiny_base.recipe_fingerprint() not in (before, after)  # the data mix counts too


def test_module_command_line_refuses_bad_limits(tmp_path, python_env):
    proc = subprocess.run([sys.executable, "-m", "megatron_dapo.tiny", "--out", str(tmp_path / "tb"), "--steps", "0"],
                          capture_output=True, text=True, env=python_env, cwd=tmp_path, timeout=300)
    assert proc.returncode == EXIT_REFUSED and "--steps and --seconds must be positive" in proc.stderr
    assert not (tmp_path / "tb").exists()
