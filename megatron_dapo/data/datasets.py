"""Load prompt datasets into `Prompt`s: DAPO-Math-17K (parquet/jsonl), GSM8K (jsonl), built-in tasks.

`load_prompts` accepts:
  - `*.parquet` or `*.jsonl` in DAPO-Math-17K format: rows with `prompt` (chat messages),
    `reward_model.ground_truth`, `data_source` and optional `extra_info`;
  - `*.jsonl` in GSM8K format: rows with `question` and `answer` ("... #### 72");
  - `builtin:<name>?<options>`, e.g. `builtin:arithmetic?n=1000&seed=0&max_digits=2` or
    `builtin:steps?n=4000&seed=0&max_steps=7` (options: `arithmetic.arithmetic_from_query`, `steps`).
Bad rows are skipped and counted by reason, never fatal; a missing file or unknown format raises.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_dapo.data.arithmetic import arithmetic_from_query
from megatron_dapo.data.steps_task import steps_from_query
from megatron_dapo.data.templates import DAPO_MATH_TEMPLATE, PromptFormat
from megatron_dapo.types import Prompt

logger = logging.getLogger(__name__)

GSM8K_PROMPT_TEMPLATE = DAPO_MATH_TEMPLATE
"""GSM8K question -> user message (data.prompt_template=auto): the instruction DAPO-Math-17K prompts carry."""

BUILTIN_TASKS: dict[str, Callable[[str], list[Prompt]]] = {"arithmetic": arithmetic_from_query,
                                                           "steps": steps_from_query}

# Skip reasons, the keys of `LoadResult.skipped`.
BAD_JSON = "bad_json"
BAD_ENCODING = "bad_encoding"
MALFORMED_ROW = "malformed_row"
MISSING_ANSWER = "missing_answer"
NON_INTEGER_ANSWER = "non_integer_answer"
PROMPT_TOO_LONG = "prompt_too_long"
PROMPT_TOO_MANY_TOKENS = "prompt_too_many_tokens"
ANSWER_TOO_LONG = "answer_too_long"

_MAX_EXAMPLES = 5
EXPECTED_FIELDS = ('expected GSM8K {"question": str, "answer": "... #### 72"} or DAPO-Math-17K {"prompt": '
                   '[{"role", "content"}, ...], "reward_model": {"ground_truth": "72"}}')
_EXPECTED = "; " + EXPECTED_FIELDS
_MAX_ANSWER_DIGITS = 100  # no benchmark answer is longer; Python refuses int() past 4300 digits
# Plain or correctly comma-grouped integers with an optional sign; a zero fraction ("12.0") is allowed.
_INTEGER_RE = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.0+)?")


class _Skip(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class LoadResult:
    """The prompts loaded from one source and what was skipped, by reason."""

    source: str
    prompts: list[Prompt] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    """reason -> number of rows skipped for it."""
    examples: dict[str, list[str]] = field(default_factory=dict)
    """reason -> the first few skipped rows (uids, or "line N" where no uid exists)."""
    longest_tokens: int = 0
    """The rendered length of the longest prompt skipped as PROMPT_TOO_MANY_TOKENS."""

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def add_skip(self, reason: str, where: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < _MAX_EXAMPLES:
            shown.append(where)

    def summary(self) -> str:
        """One line: how many prompts were loaded, how many skipped per reason, with examples."""
        text = f"loaded {len(self.prompts)} prompts from {self.source}"
        if not self.skipped:
            return text
        parts = [
            f"{r}={n} (e.g. {', '.join(self.examples.get(r, []))}{_EXPECTED if r == MALFORMED_ROW else ''})"
            for r, n in sorted(self.skipped.items())
        ]
        return f"{text}; skipped {self.num_skipped}: " + "; ".join(parts)


def normalize_integer_answer(value: Any) -> str | None:
    """Canonical integer string for "1,000", "+5", "007", "-3", "12.0", 42; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value)
    if not isinstance(value, str):
        return None
    text = value.strip()
    if not _INTEGER_RE.fullmatch(text):
        return None
    digits = text.split(".")[0].replace(",", "")
    if len(digits.lstrip("+-")) > _MAX_ANSWER_DIGITS:
        return None
    return str(int(digits))


def _answer(value: Any) -> str:
    """The canonical integer answer of a row, or a _Skip saying why there is none."""
    answer = normalize_integer_answer(value)
    if answer is None:
        long = isinstance(value, str) and len(value.strip()) > _MAX_ANSWER_DIGITS and _INTEGER_RE.fullmatch(value.strip())
        raise _Skip(ANSWER_TOO_LONG if long else NON_INTEGER_ANSWER)
    return answer


def _as_messages(prompt: Any) -> tuple[dict[str, str], ...]:
    """Chat messages from a list, tuple or numpy array of {"role", "content"} dicts (or a bare string)."""
    if isinstance(prompt, str):
        return ({"role": "user", "content": prompt},)
    if isinstance(prompt, (dict, bytes)) or not hasattr(prompt, "__iter__"):
        raise _Skip(MALFORMED_ROW)
    messages = []
    for message in prompt:
        if not isinstance(message, dict):
            raise _Skip(MALFORMED_ROW)
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise _Skip(MALFORMED_ROW)
        messages.append({"role": role, "content": content})
    if not messages:
        raise _Skip(MALFORMED_ROW)
    return tuple(messages)


def _dapo_prompt(row: dict[str, Any], index: int, default_source: str) -> Prompt:
    source = str(row.get("data_source") or default_source)
    messages = _as_messages(row.get("prompt"))
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict):
        raise _Skip(MALFORMED_ROW)
    truth = reward_model.get("ground_truth")
    if truth is None or (isinstance(truth, str) and not truth.strip()):
        raise _Skip(MISSING_ANSWER)
    answer = _answer(truth)
    return Prompt(uid=f"{source}/{index}", messages=messages, ground_truth=answer, data_source=source)


def _gsm8k_prompt(row: dict[str, Any], index: int, default_source: str) -> Prompt:
    question, solution = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not isinstance(solution, str):
        raise _Skip(MALFORMED_ROW)
    if "####" not in solution:
        raise _Skip(MISSING_ANSWER)
    answer = _answer(solution.rsplit("####", 1)[1])
    content = GSM8K_PROMPT_TEMPLATE.format(question=question.strip())
    return Prompt(
        uid=f"gsm8k/{index}",
        messages=({"role": "user", "content": content},),
        ground_truth=answer,
        data_source="gsm8k",
    )


def _iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(0-based line number, parsed row, or BAD_JSON / BAD_ENCODING for a line that is not JSON / not
    UTF-8); blank lines are skipped."""
    with path.open("rb") as f:
        for index, raw in enumerate(f):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield index, BAD_ENCODING
                continue
            if not line.strip():
                continue
            try:
                yield index, json.loads(line)
            except (json.JSONDecodeError, ValueError):  # ValueError: a number past int()'s digit limit
                yield index, BAD_JSON


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        index = 0
        for batch in parquet.iter_batches(batch_size=4096):
            for row in batch.to_pylist():
                yield index, row
                index += 1
    except Exception as e:  # pyarrow raises several types for a corrupt or non-parquet file
        raise ValueError(f"cannot read parquet file {path}: {e}") from e


def _row_parser(row: dict[str, Any], path: Path) -> Callable[[dict[str, Any], int, str], Prompt]:
    if "prompt" in row:
        return _dapo_prompt
    if "question" in row:
        return _gsm8k_prompt
    raise ValueError(
        f"unrecognised dataset format in {path}: first row has keys {sorted(row)}; expected DAPO-Math-17K "
        "('prompt', 'reward_model', 'data_source') or GSM8K ('question', 'answer')"
    )


@dataclass(frozen=True)
class _Limits:
    max_chars: int | None = None
    max_tokens: int | None = None
    count_tokens: Callable[[Prompt], int] | None = None


def _load_file(path: Path, result: LoadResult, limits: _Limits, limit: int | None, fmt: PromptFormat) -> None:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        rows = _iter_parquet(path)
    elif suffix == ".jsonl":
        rows = _iter_jsonl(path)
    else:
        raise ValueError(f"unrecognised dataset extension {suffix!r} for {path}; expected .parquet or .jsonl")
    parse = None
    default_source = path.stem
    for index, row in rows:
        if limit is not None and len(result.prompts) >= limit:
            break
        if row in (BAD_JSON, BAD_ENCODING):
            result.add_skip(row, f"line {index + 1}")
            continue
        if not isinstance(row, dict):
            result.add_skip(MALFORMED_ROW, f"line {index + 1}")
            continue
        parse = parse or _row_parser(row, path)
        try:
            prompt = parse(row, index, default_source)
        except _Skip as skip:
            source = row.get("data_source") if parse is _dapo_prompt else "gsm8k"
            result.add_skip(skip.reason, f"{source or default_source}/{index}")
            continue
        _keep(result, prompt, limits, fmt)


def _keep(result: LoadResult, prompt: Prompt, limits: _Limits, fmt: PromptFormat) -> None:
    try:
        prompt = fmt.apply(prompt)
    except ValueError:  # no user message to put the template on
        result.add_skip(MALFORMED_ROW, prompt.uid)
        return
    if limits.max_chars is not None and sum(len(m["content"]) for m in prompt.messages) > limits.max_chars:
        result.add_skip(PROMPT_TOO_LONG, prompt.uid)
    elif limits.max_tokens is not None and (tokens := limits.count_tokens(prompt)) > limits.max_tokens:
        result.add_skip(PROMPT_TOO_MANY_TOKENS, prompt.uid)
        result.longest_tokens = max(result.longest_tokens, tokens)
    else:
        result.prompts.append(prompt)


def load_prompts(path: str, *, max_prompt_chars: int | None = None, limit: int | None = None,
                 max_prompt_tokens: int | None = None, count_tokens: Callable[[Prompt], int] | None = None,
                 prompt_format: PromptFormat | None = None, log_skipped: bool = True) -> LoadResult:
    """Load prompts from a dataset file or a `builtin:` spec (see the module docstring).

    uids are `<data_source>/<row index>` (jsonl: 0-based line number) and stay stable when rows are
    skipped. `prompt_format` (templates.py) rewrites each prompt's messages before the length checks:
    `max_prompt_chars` drops prompts whose message contents are longer in total; `max_prompt_tokens`
    those for which `count_tokens(prompt)` (the rendered prompt's length) is larger; `limit` stops after
    that many prompts are kept. Raises FileNotFoundError / ValueError for a missing file or an
    unrecognised format; bad rows (not JSON, not UTF-8, malformed, no integer answer, too long) are
    counted in `LoadResult.skipped` and logged as one warning naming the file and rows (unless not
    `log_skipped`).
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if max_prompt_tokens is not None and count_tokens is None:
        raise ValueError("max_prompt_tokens needs count_tokens (a tokenizer's length of the rendered prompt)")
    limits = _Limits(max_prompt_chars, max_prompt_tokens, count_tokens)
    result = LoadResult(source=str(path))
    fmt = prompt_format or PromptFormat()
    if str(path).startswith("builtin:"):
        name, _, query = str(path)[len("builtin:") :].partition("?")
        if name not in BUILTIN_TASKS:
            raise ValueError(
                f"unknown builtin dataset {name!r} in {path!r}; available: {sorted(BUILTIN_TASKS)}"
            )
        for prompt in BUILTIN_TASKS[name](query):
            if limit is not None and len(result.prompts) >= limit:
                break
            _keep(result, prompt, limits, fmt)
    else:
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"dataset file not found: {path}")
        _load_file(file, result, limits, limit, fmt)
    if result.skipped and log_skipped:
        logger.warning(result.summary())
    return result
