"""The run's training and validation prompts: the dataset files through the prompt template, with the
rows that cannot be used (malformed, too long in characters or in rendered tokens) skipped and counted."""

from __future__ import annotations

import logging
from typing import Any

from megatron_dapo.config import Config
from megatron_dapo.data import PromptFormat, load_prompts
from megatron_dapo.data.datasets import PROMPT_TOO_MANY_TOKENS, LoadResult
from megatron_dapo.data.render import render_prompt_ids
from megatron_dapo.loop.preflight import SetupError
from megatron_dapo.loop.report import StartupReport
from megatron_dapo.types import Prompt

log = logging.getLogger(__name__)


def _load(path: str, cfg: Config, tokenizer: Any, fmt: PromptFormat | None, **kw: Any) -> LoadResult:
    """Prompts of `path`; those longer than rollout.max_prompt_len tokens, rendered the way the rollout
    renders them, are skipped and counted."""
    try:
        return load_prompts(path, max_prompt_chars=cfg.data.max_prompt_chars,
                            max_prompt_tokens=cfg.rollout.max_prompt_len,
                            count_tokens=lambda p: len(render_prompt_ids(tokenizer, p)), prompt_format=fmt, **kw)
    except (FileNotFoundError, ValueError) as e:
        raise SetupError(str(e)) from e


def _summary(loaded: LoadResult, cfg: Config) -> str:
    """The loader's summary; where prompts rendered too long, the setting and template that decide it."""
    text = loaded.summary()
    if PROMPT_TOO_MANY_TOKENS in loaded.skipped:
        text += (f"; the longest rendered prompt has {loaded.longest_tokens} tokens with data.prompt_template="
                 f"{cfg.data.prompt_template} and model.chat_template={cfg.model.chat_template}, over "
                 f"rollout.max_prompt_len={cfg.rollout.max_prompt_len}: raise rollout.max_prompt_len or use a "
                 "shorter template (data.prompt_template=raw for a tiny character-level model)")
    return text


def _note(report: StartupReport | None, line: str) -> None:
    if report is not None:
        report.data.append(line)
    else:
        log.info(line)


def load_train_prompts(cfg: Config, tokenizer: Any, fmt: PromptFormat | None = None,
                       report: StartupReport | None = None) -> LoadResult:
    loaded = _load(cfg.data.train_path, cfg, tokenizer, fmt)
    _note(report, f"training prompts: {_summary(loaded, cfg)}")
    if not loaded.prompts:
        raise SetupError(f"data.train_path={cfg.data.train_path!r}: no usable prompt ({_summary(loaded, cfg)})")
    if len(loaded.prompts) < cfg.train.prompt_batch_size:  # loop/inputs.py counts exactly only small datasets
        raise SetupError(f"train.prompt_batch_size={cfg.train.prompt_batch_size} is larger than the "
                         f"{len(loaded.prompts)} usable prompts of data.train_path={cfg.data.train_path} "
                         f"({_summary(loaded, cfg)})")
    return loaded


def load_val_prompts(cfg: Config, tokenizer: Any, fmt: PromptFormat | None = None,
                     report: StartupReport | None = None) -> list[Prompt]:
    if not cfg.data.val_path:
        _note(report, "validation prompts: none (data.val_path unset)")
        return []
    loaded = _load(cfg.data.val_path, cfg, tokenizer, fmt, limit=cfg.eval.max_prompts)
    _note(report, f"validation prompts: {_summary(loaded, cfg)}")
    return loaded.prompts
