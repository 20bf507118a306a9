"""Impossible runs are refused before anything loads (no process group, no model, no engine), by the run and
by `--dry-run` alike, each problem one line naming the setting: the model folder and its tokenizer
(preflight.check_model), a missing, unreadable or empty dataset file, a `train.prompt_batch_size` larger
than the training set, a `train.rollout_budget` that cannot hold one batch, a `rollout.max_prompt_len` that
every prompt exceeds.

Cheaply: a parquet file's rows are counted from its footer, a jsonl file's lines are counted without parsing
them; only the first SAMPLE usable prompts are rendered and tokenized (all of them in a smaller dataset, whose
usable prompts are then counted exactly). The driver's full load later skips and counts the rest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from megatron_dapo.config import Config
from megatron_dapo.data import PromptFormat, load_prompts
from megatron_dapo.data.datasets import BUILTIN_TASKS
from megatron_dapo.data.render import render_prompt_ids
from megatron_dapo.loop.preflight import SetupError, check_model

SAMPLE = 512
"""Prompts rendered and tokenized per dataset (about a second with a chat template)."""


class Inputs(NamedTuple):
    tokenizer: Any
    prompt_format: PromptFormat


def check_inputs(cfg: Config) -> Inputs:
    """Raise SetupError for the first impossible input; else the tokenizer and the prompt format."""
    tokenizer = check_model(cfg.model.hf_dir)
    try:
        fmt = PromptFormat.from_files(cfg.data.prompt_template, cfg.data.system_prompt, cfg.data.few_shot_path)
    except (ValueError, OSError) as e:
        raise SetupError(str(e)) from e
    rows = count_rows("data.train_path", cfg.data.train_path)
    usable = check_prompts("data.train_path", cfg.data.train_path, cfg, tokenizer, fmt)
    check_batch(cfg, rows)
    if usable is not None and usable < cfg.train.prompt_batch_size:
        raise SetupError(f"train.prompt_batch_size={cfg.train.prompt_batch_size} is larger than the {usable} usable "
                         f"prompts of data.train_path={cfg.data.train_path} ({rows} rows): lower it to at most "
                         f"{usable}")
    if cfg.data.val_path:
        count_rows("data.val_path", cfg.data.val_path)
        check_prompts("data.val_path", cfg.data.val_path, cfg, tokenizer, fmt)
    return Inputs(tokenizer, fmt)


def check_batch(cfg: Config, rows: int) -> None:
    """One step's batch against the training set's `rows` and the rollout budget."""
    n, g, budget, path = cfg.train.prompt_batch_size, cfg.algo.group_size, cfg.train.rollout_budget, cfg.data.train_path
    if n > rows:
        raise SetupError(f"train.prompt_batch_size={n} is larger than data.train_path={path}, which has {rows} "
                         f"prompts: lower it to at most {rows}")
    if budget and budget < n * g:
        raise SetupError(f"train.rollout_budget={budget} responses cannot hold one batch: train.prompt_batch_size={n} "
                         f"prompts x algo.group_size={g} = {n * g} responses (the budget holds {budget // g} prompts; "
                         f"data.train_path has {rows})")


def count_rows(setting: str, path: str) -> int:
    """Rows of a dataset without parsing them: parquet from its footer, jsonl by its non-blank lines."""
    if path.startswith("builtin:"):
        name = path[len("builtin:"):].partition("?")[0]
        if name not in BUILTIN_TASKS:
            raise SetupError(f"{setting}={path}: unknown builtin dataset {name!r}; available: {sorted(BUILTIN_TASKS)}")
        return len(BUILTIN_TASKS[name](path.partition("?")[2]))
    file = Path(path)
    if not file.exists():
        raise SetupError(f"{setting}={path}: no such file")
    if file.suffix.lower() not in (".parquet", ".jsonl"):
        raise SetupError(f"{setting}={path}: unrecognised dataset extension {file.suffix!r}; expected .parquet or "
                         ".jsonl")
    try:
        if file.suffix.lower() == ".parquet":
            import pyarrow.parquet as pq

            return int(pq.ParquetFile(file).metadata.num_rows)
        with file.open("rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError as e:
        raise SetupError(f"{setting}={path}: cannot read it ({e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a file that is not parquet
        raise SetupError(f"{setting}={path}: not a readable parquet file ({e})") from None


def check_prompts(setting: str, path: str, cfg: Config, tokenizer: Any, fmt: PromptFormat) -> int | None:
    """The first SAMPLE usable prompts of `path`, rendered as the rollout renders them: refused if none is
    usable or every one is longer than rollout.max_prompt_len tokens. Returns how many prompts of the dataset
    fit when it has at most SAMPLE usable ones (then all were read), else None."""
    try:
        loaded = load_prompts(path, max_prompt_chars=cfg.data.max_prompt_chars, limit=SAMPLE, prompt_format=fmt,
                              log_skipped=False)  # the driver's full load reports them
    except (ValueError, OSError) as e:
        raise SetupError(f"{setting}={path}: {e}") from None
    if not loaded.prompts:
        raise SetupError(f"{setting}={path}: no usable prompt ({loaded.summary()})")
    lengths = sorted(len(render_prompt_ids(tokenizer, p)) for p in loaded.prompts)
    limit, whole = cfg.rollout.max_prompt_len, len(loaded.prompts) < SAMPLE
    if lengths[0] > limit:
        which = f"every one of its {len(lengths)} usable prompts" if whole else f"each of its first {SAMPLE} prompts"
        raise SetupError(f"rollout.max_prompt_len={limit} tokens: {which} is longer ({setting}={path}; the shortest "
                         f"renders to {lengths[0]} tokens): raise it to at least {lengths[0]}")
    return sum(n <= limit for n in lengths) if whole else None
