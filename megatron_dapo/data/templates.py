"""How a dataset row becomes chat messages: the prompt template, a system prompt, few-shot examples.

`data.prompt_template`:
  - `auto`: each dataset's own form. DAPO-Math-17K rows keep their messages as stored (they already
    carry the DAPO instruction); GSM8K questions get that same instruction; the arithmetic task is the
    bare "37+45=" (or its instruct style, see arithmetic.py).
  - `dapo_math`: the DAPO-Math-17K instruction around the problem (`DAPO_MATH_TEMPLATE`).
  - `dapo_math_tool`: the same, telling the model it may run Python in a ```python block and read its
    output in an ```output block (rollout.tools with its default fences; `DAPO_MATH_TOOL_TEMPLATE`).
  - `gsm8k`: the usual GSM8K suffix asking for the answer after "####" (read by the reward only
    with `reward.answer_fallback=boxed`).
  - `raw`: the question alone (base models, with few-shot examples and `model.chat_template=none`).
  - a file: Jinja (`*.jinja`, `*.j2`) or a Python format string, with the fields `{question}` (alias
    `{problem}`) and `{data_source}`.
The question of a row is its last user message with the DAPO instruction stripped when present, so
any template also applies to DAPO-Math-17K rows.

`data.system_prompt` (None: the row's own system message if any, else none; note that some chat
templates add a default one then, reported at start-up by render.default_system_prompt) and
`data.few_shot_path` (jsonl rows {"question", "response"}: user / assistant turns before the prompt,
the questions formatted like the prompt) complete the messages.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from megatron_dapo.config.schema import PROMPT_TEMPLATES
from megatron_dapo.types import Prompt

DAPO_MATH_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the "
    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    "{question}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
"""The instruction of every DAPO-Math-17K prompt, around the problem."""
DAPO_MATH_TOOL_TEMPLATE = (
    "Solve the following math problem step by step. You may run Python to compute: write the code in a "
    "```python block; what it prints comes back in an ```output block right after it. The last line of your "
    "response should be of the form Answer: $Answer (without quotes) where $Answer is the answer to the "
    "problem.\n\n"
    "{question}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
"""DAPO's instruction for tool-integrated reasoning (rollout.tools.name=python with its default fences)."""
GSM8K_HASH_TEMPLATE = "{question} Let's think step by step and output the final answer after \"####\"."
BUILTIN_TEMPLATES = {"dapo_math": DAPO_MATH_TEMPLATE, "dapo_math_tool": DAPO_MATH_TOOL_TEMPLATE,
                     "gsm8k": GSM8K_HASH_TEMPLATE, "raw": "{question}"}
TEMPLATE_NAMES = PROMPT_TEMPLATES
_PREFIX, _SUFFIX = DAPO_MATH_TEMPLATE.split("{question}")

Message = dict[str, str]


def question_of(content: str) -> str:
    """The problem inside a user message: the DAPO instruction stripped when it wraps the text."""
    if content.startswith(_PREFIX) and content.endswith(_SUFFIX) and len(content) >= len(_PREFIX) + len(_SUFFIX):
        return content[len(_PREFIX): len(content) - len(_SUFFIX)]
    return content


def _format_fn(text: str, origin: str) -> Callable[[str, str], str]:
    """A Python format string with {question} / {problem} / {data_source}, checked on a probe."""
    def render(question: str, data_source: str) -> str:
        return text.format(question=question, problem=question, data_source=data_source)

    try:
        probe = render("\x00Q\x00", "src")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"prompt template {origin}: not a valid format string with the fields "
                         f"{{question}}, {{problem}}, {{data_source}} ({type(e).__name__}: {e})") from e
    if "\x00Q\x00" not in probe:
        raise ValueError(f"prompt template {origin}: it never uses {{question}} (or {{problem}})")
    return render


def _jinja_fn(text: str, origin: str) -> Callable[[str, str], str]:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        template = ImmutableSandboxedEnvironment(keep_trailing_newline=True).from_string(text)
        probe = template.render(question="\x00Q\x00", problem="\x00Q\x00", data_source="src")
    except TemplateError as e:
        raise ValueError(f"prompt template {origin}: Jinja error ({e})") from e
    if "\x00Q\x00" not in probe:
        raise ValueError(f"prompt template {origin}: it never uses {{{{ question }}}} (or problem)")
    return lambda question, data_source: template.render(question=question, problem=question,
                                                         data_source=data_source)


def template_fn(name: str) -> Callable[[str, str], str] | None:
    """(question, data_source) -> user message for a built-in name or a file; None for `auto`."""
    if name == "auto":
        return None
    if name in BUILTIN_TEMPLATES:
        return _format_fn(BUILTIN_TEMPLATES[name], name)
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"data.prompt_template={name!r}: not one of {list(TEMPLATE_NAMES)} and no such file")
    text = path.read_text(encoding="utf-8")
    return (_jinja_fn if path.suffix in (".jinja", ".j2") else _format_fn)(text, str(path))


def load_few_shot(path: str) -> tuple[tuple[str, str], ...]:
    """(question, response) pairs from a jsonl file of {"question", "response"} rows."""
    pairs = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"data.few_shot_path={path}: line {number} is not JSON ({e})") from e
            if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("question", "response")):
                raise ValueError(f'data.few_shot_path={path}: line {number} needs string "question" and '
                                 f'"response" fields')
            pairs.append((row["question"], row["response"]))
    if not pairs:
        raise ValueError(f"data.few_shot_path={path}: no example")
    return tuple(pairs)


@dataclass(frozen=True)
class PromptFormat:
    """Rewrites a loaded Prompt's messages (see the module docstring); the identity when all is default."""

    template: str = "auto"
    system_prompt: str | None = None
    few_shot: tuple[tuple[str, str], ...] = ()
    _fn: Callable[[str, str], str] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_fn", template_fn(self.template))  # checks it, reads a file once

    @classmethod
    def from_files(cls, template: str = "auto", system_prompt: str | None = None,
                   few_shot_path: str | None = None) -> PromptFormat:
        """Checks the template and reads the few-shot file (ValueError naming the problem)."""
        return cls(template, system_prompt, load_few_shot(few_shot_path) if few_shot_path else ())

    @property
    def is_identity(self) -> bool:
        return self.template == "auto" and self.system_prompt is None and not self.few_shot

    def apply(self, prompt: Prompt) -> Prompt:
        if self.is_identity:
            return prompt
        messages = list(prompt.messages)
        last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        if last is None:
            raise ValueError(f"{prompt.uid}: no user message to format")
        user = messages[last]["content"]
        system = [m for m in messages[:last] if m["role"] == "system"]
        history = [m for m in messages[:last] if m["role"] != "system"]
        fmt = self._user_formatter(user)
        out: list[Message] = [{"role": "system", "content": self.system_prompt}] if self.system_prompt is not None \
            else system
        for question, response in self.few_shot:
            out += [{"role": "user", "content": fmt(question, prompt.data_source)},
                    {"role": "assistant", "content": response}]
        out += history + [{"role": "user", "content": fmt(question_of(user), prompt.data_source)}]
        return replace(prompt, messages=tuple(out))

    def _user_formatter(self, user: str) -> Callable[[str, str], str]:
        """The template; under `auto`, the form the row itself uses (DAPO instruction, or the bare text)."""
        if self._fn is not None:
            return self._fn
        return _AUTO_DAPO if question_of(user) != user else _AUTO_RAW


_AUTO_DAPO, _AUTO_RAW = _format_fn(DAPO_MATH_TEMPLATE, "dapo_math"), _format_fn("{question}", "raw")
