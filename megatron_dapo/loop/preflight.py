"""Checks of the model folder before anything heavy loads: each problem is one line naming the file.

config.json must parse and describe a supported architecture, the safetensors headers must be intact
and complete, and the tokenizer files must be there and encode text (without them a run used to fail
only at the first rollout, with "prompt 0 is empty").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_dapo.cli import UserError
from megatron_dapo.data.render import render_prompt_ids
from megatron_dapo.types import Prompt

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "tokenizer.tiktoken")
_PROBE = Prompt(uid="preflight", messages=({"role": "user", "content": "What is 12 + 7?"},), ground_truth="19")


class SetupError(UserError):
    """A run cannot start (missing or broken model, empty dataset): one line, exit 2, no traceback."""


def check_model(hf_dir: str | None) -> Any:
    """Raise SetupError for the first problem of the model folder; else return its tokenizer."""
    from megatron_dapo.actor.model import UnsupportedModelError, load_hf_config, spec_from_hf
    from megatron_dapo.hf_files import HFCheckpointError, hf_tensor_table

    config = Path(hf_dir or "") / "config.json"
    if not hf_dir or not config.is_file():
        tiny = Path(hf_dir or "").name == "tiny_base"  # the only model we can build for you
        raise SetupError(f"model.hf_dir={hf_dir!r} ({Path(hf_dir or '.').resolve()}) has no config.json" + (
            " (build the tiny base with `python tools/make_tiny_base.py --out checkpoints/tiny_base`)" if tiny else
            ": point it at a Hugging Face folder (config.json, *.safetensors, tokenizer files)"))
    try:
        json.loads(config.read_text())
    except (ValueError, OSError) as e:
        raise SetupError(f"{config}: not valid JSON ({e})") from None
    try:
        spec_from_hf(load_hf_config(hf_dir))
        hf_tensor_table(hf_dir)
    except (UnsupportedModelError, HFCheckpointError) as e:
        raise SetupError(f"model.hf_dir={hf_dir}: {e}") from None
    except (ValueError, KeyError, OSError) as e:  # transformers cannot read the config
        raise SetupError(f"{config}: {_first_line(e)}") from None
    return load_tokenizer(hf_dir)


def load_tokenizer(hf_dir: str) -> Any:
    from transformers import AutoTokenizer

    present = [f for f in TOKENIZER_FILES if (Path(hf_dir) / f).is_file()]
    if not present:
        raise SetupError(f"model.hf_dir={hf_dir}: no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); "
                         "copy them from the base model")
    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        ids = render_prompt_ids(tokenizer, _PROBE)
    except Exception as e:  # noqa: BLE001 - tokenizers raise many types for broken files
        raise SetupError(f"model.hf_dir={hf_dir}: cannot load its tokenizer ({_first_line(e)})") from None
    if not ids:
        raise SetupError(f"model.hf_dir={hf_dir}: the tokenizer ({', '.join(present)}) encodes text to no "
                         "tokens: broken or mismatched tokenizer files")
    return tokenizer


def checkpoint_bytes(hf_dir: str, bf16: bool) -> int:
    """About one checkpoint's size: weights + Adam moments (+ fp32 main weights with bf16)."""
    from megatron_dapo.hf_files import hf_tensor_table

    params = sum(_numel(info.shape) for info in hf_tensor_table(hf_dir).values())
    return params * (2 + 4 + 8 if bf16 else 4 + 8)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
