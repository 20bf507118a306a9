"""Built-in multi-step task: a chain of operations evaluated left to right, worked out line by line.

    prompt   "7+5*3-9="                      (left to right: ((7+5)*3)-9)
    target   "7+5=12\\n12*3=36\\n36-9=27\\nAnswer: 27"

Difficulty knob: the number of operations k, drawn uniformly from [min_steps, max_steps]; a worked
response takes about 8 tokens per step with the character-level tiny tokenizer, so responses run from
a dozen tokens (k=1) to 60+ (k=7), and a model that errs on a step with probability e gets a k-step
problem right with probability about (1-e)^k. Every operand is 1..max_operand and every running value
stays in [0, max_value], so each line is small-number arithmetic; the ground truth is an integer, and
the DAPO reward reads it after "Answer:" unchanged.

Spec string (`builtin:steps?...`): n (1000), seed (0), min_steps (1), max_steps (6), max_value (99),
max_operand (9), max_start (20), ops ("+-*"), split (all). Deterministic for a spec; prompt i has uid
"steps/i" and the stream is prefix-stable (n=10 gives the first 10 of n=100). split=train / split=val
keep only the questions of that side of a fixed hash partition (one question in `VAL_BUCKETS` is val),
so a train and a val set never share a question, however short the chains.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_dapo.data.arithmetic import apply_op, format_answer
from megatron_dapo.types import Prompt

DATA_SOURCE = "steps"
SUPPORTED_OPS = ("+", "-", "*")
SPLITS = ("all", "train", "val")
VAL_BUCKETS = 8
_DEFAULTS: dict[str, int | str] = {"n": 1000, "seed": 0, "min_steps": 1, "max_steps": 6, "max_value": 99,
                                   "max_operand": 9, "max_start": 20, "ops": "+-*", "split": "all"}
_TEXT_KEYS = ("ops", "split")
_TERM = re.compile(r"([+\-*])(\d+)")


@dataclass(frozen=True)
class Chain:
    """`start`, then each (op, operand) applied left to right."""

    start: int
    ops: tuple[tuple[str, int], ...]

    def values(self) -> list[int]:
        """The running value after each operation (the last one is the answer)."""
        out, v = [], self.start
        for op, d in self.ops:
            v = apply_op(v, op, d)
            out.append(v)
        return out

    @property
    def answer(self) -> int:
        return self.values()[-1]

    def question(self) -> str:
        """The prompt text, e.g. "7+5*3-9="."""
        return f"{self.start}" + "".join(f"{op}{d}" for op, d in self.ops) + "="

    def lines(self) -> list[str]:
        """One worked line per operation: "7+5=12", "12*3=36", "36-9=27"."""
        before = [self.start, *self.values()[:-1]]
        return [f"{v}{op}{d}={after}" for v, (op, d), after in zip(before, self.ops, self.values())]


def worked_solution(chain: Chain) -> str:
    """The step-by-step response: the worked lines, then "Answer: N"."""
    return "\n".join([*chain.lines(), format_answer(chain.answer)])


def parse_chain(question: str) -> Chain:
    """The `Chain` of a prompt text such as "7+5*3-9=" (inverse of `Chain.question`)."""
    m = re.fullmatch(r"(\d+)((?:[+\-*]\d+)+)=", question)
    if m is None:
        raise ValueError(f"not a steps question: {question!r}")
    return Chain(int(m.group(1)), tuple((op, int(d)) for op, d in _TERM.findall(m.group(2))))


def chain_of(prompt: Prompt) -> Chain:
    return parse_chain(prompt.messages[-1]["content"])


def _next_op(rng: random.Random, v: int, ops: Sequence[str], max_value: int, max_operand: int
             ) -> tuple[str, int]:
    """A uniformly drawn feasible op, then a uniform operand keeping the value in [0, max_value]."""
    limits = {"+": (1, min(max_operand, max_value - v)), "-": (1, min(max_operand, v)),
              "*": (2, min(max_operand, max_value // v) if v > 0 else 0)}
    feasible = [op for op in ops if limits[op][0] <= limits[op][1]]  # "+" or "-" always is
    op = feasible[rng.randrange(len(feasible))]
    low, high = limits[op]
    return op, rng.randint(low, high)


def split_of(question: str) -> str:
    """"val" for one question in VAL_BUCKETS (by a hash of its text), else "train"."""
    return "val" if int(hashlib.sha256(question.encode()).hexdigest(), 16) % VAL_BUCKETS == 0 else "train"


def make_steps_prompts(n: int, seed: int, *, min_steps: int = 1, max_steps: int = 6, max_value: int = 99,
                       max_operand: int = 9, max_start: int = 20, ops: Sequence[str] = SUPPORTED_OPS,
                       split: str = "all") -> list[Prompt]:
    """`n` seeded chains (see the module docstring); its own `random.Random(seed)`."""
    ops = tuple(ops)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not 1 <= min_steps <= max_steps:
        raise ValueError(f"need 1 <= min_steps <= max_steps, got {min_steps}, {max_steps}")
    if any(op not in SUPPORTED_OPS for op in ops) or not {"+", "-"} <= set(ops):
        raise ValueError(f"ops must be + and -, optionally *, got {ops}")
    if not 1 <= max_start <= max_value or max_operand < 2:
        raise ValueError(f"need 1 <= max_start <= max_value and max_operand >= 2, got "
                         f"max_start={max_start}, max_value={max_value}, max_operand={max_operand}")
    rng = random.Random(seed)
    prompts: list[Prompt] = []
    for _ in range(100 * n + 1000):  # a split keeps 1/8 or 7/8 of the draws; a tiny task may run dry
        if len(prompts) == n:
            return prompts
        chain = _draw_chain(rng, ops, min_steps, max_steps, max_value, max_operand, max_start)
        if split in ("all", split_of(chain.question())):
            prompts.append(Prompt(uid=f"{DATA_SOURCE}/{len(prompts)}", ground_truth=str(chain.answer),
                                  messages=({"role": "user", "content": chain.question()},), data_source=DATA_SOURCE))
    raise ValueError(f"could not draw {n} {split} problems (the settings allow too few distinct questions)")


def _draw_chain(rng: random.Random, ops: Sequence[str], min_steps: int, max_steps: int, max_value: int,
                max_operand: int, max_start: int) -> Chain:
    v = start = rng.randint(1, max_start)
    steps = []
    for _ in range(rng.randint(min_steps, max_steps)):
        op, d = _next_op(rng, v, ops, max_value, max_operand)
        steps.append((op, d))
        v = apply_op(v, op, d)
    return Chain(start, tuple(steps))


def steps_from_query(query: str) -> list[Prompt]:
    """Prompts from a spec query such as "n=4000&seed=0&max_steps=7" (keys: see the module docstring)."""
    params = dict(_DEFAULTS)
    for item in filter(None, query.split("&")):
        key, sep, value = item.partition("=")
        if not sep or key not in _DEFAULTS:
            raise ValueError(f"bad builtin:steps option {item!r}; keys: {sorted(_DEFAULTS)}")
        if key in _TEXT_KEYS:
            params[key] = value.replace(",", "")
            continue
        try:
            params[key] = int(value)
        except ValueError:
            raise ValueError(f"builtin:steps option {key} must be an integer, got {value!r}") from None
    ops, split = tuple(str(params.pop("ops"))), str(params.pop("split"))
    n, seed = int(params.pop("n")), int(params.pop("seed"))
    return make_steps_prompts(n, seed, ops=ops, split=split, **{k: int(v) for k, v in params.items()})
