"""Built-in integer-answer task: short arithmetic problems such as "37+45=", answered "Answer: 82".

Two styles of user message: `plain` ("37+45=", what the tiny base is warm-started on) and `instruct`
(`ARITHMETIC_INSTRUCTION`, which tells an instruct model the "Answer:" form the reward reads).

The prompt format lives in `format_arithmetic_question` and the response format in `arithmetic_target`,
so a supervised warm-start script renders exactly what the RL loop trains on.
"""

from __future__ import annotations

import random

from megatron_dapo.types import Prompt

DATA_SOURCE = "arithmetic"
SUPPORTED_OPS = ("+", "-", "*")
ANSWER_PREFIX = "Answer: "
"""The response format the DAPO reward parser reads (the last "Answer:" line)."""

_SPEC_DEFAULTS: dict[str, int | str] = {"n": 1000, "seed": 0, "min_digits": 1, "max_digits": 2, "ops": "+-*",
                                        "style": "plain"}
STYLES = ("plain", "instruct")
ARITHMETIC_INSTRUCTION = ('Compute {expression}. End your response with a line of the form "Answer: N", '
                          "where N is the integer result.")


def format_arithmetic_question(a: int, op: str, b: int, style: str = "plain") -> str:
    """The user message for `a op b`, e.g. `format_arithmetic_question(12, "+", 7) == "12+7="`;
    style="instruct": `ARITHMETIC_INSTRUCTION` around "12+7"."""
    if op not in SUPPORTED_OPS:
        raise ValueError(f"unsupported op {op!r}; expected one of {SUPPORTED_OPS}")
    if style not in STYLES:
        raise ValueError(f"unsupported style {style!r}; expected one of {STYLES}")
    return f"{a}{op}{b}=" if style == "plain" else ARITHMETIC_INSTRUCTION.format(expression=f"{a}{op}{b}")


def apply_op(a: int, op: str, b: int) -> int:
    """The exact integer value of `a op b`."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unsupported op {op!r}; expected one of {SUPPORTED_OPS}")


def format_answer(value: int | str) -> str:
    """The response text that states `value` as the final answer: "Answer: N"."""
    return f"{ANSWER_PREFIX}{value}"


def arithmetic_target(prompt: Prompt) -> str:
    """The correct response to an arithmetic prompt ("Answer: N"), for supervised warm-start."""
    return format_answer(prompt.ground_truth)


def _sample_operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    digits = rng.randint(min_digits, max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def make_arithmetic_prompts(
    n: int,
    seed: int,
    *,
    min_digits: int = 1,
    max_digits: int = 2,
    ops: tuple[str, ...] | str = SUPPORTED_OPS,
    style: str = "plain",
) -> list[Prompt]:
    """`n` seeded problems `a op b` with non-negative operands of `min_digits..max_digits` digits.

    Deterministic for a given (n, seed, min_digits, max_digits, ops): uses its own `random.Random(seed)`.
    Prompt i has uid "arithmetic/i" and is a prefix-stable stream: n=10 gives the first 10 of n=100.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    ops = tuple(ops)
    if not ops or any(op not in SUPPORTED_OPS for op in ops):
        raise ValueError(f"ops must be a non-empty subset of {SUPPORTED_OPS}, got {ops}")
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        a = _sample_operand(rng, min_digits, max_digits)
        b = _sample_operand(rng, min_digits, max_digits)
        op = ops[rng.randrange(len(ops))]
        prompts.append(
            Prompt(
                uid=f"{DATA_SOURCE}/{i}",
                messages=({"role": "user", "content": format_arithmetic_question(a, op, b, style)},),
                ground_truth=str(apply_op(a, op, b)),
                data_source=DATA_SOURCE,
            )
        )
    return prompts


def arithmetic_from_query(query: str) -> list[Prompt]:
    """Build prompts from the query part of a spec string, e.g. "n=1000&seed=0&max_digits=2&ops=+-".

    Keys: n (1000), seed (0), min_digits (1), max_digits (2), ops ("+-*", characters; commas ignored),
    style (plain | instruct).
    Unlike URL decoding, "+" stays a plus sign.
    """
    params: dict[str, int | str] = dict(_SPEC_DEFAULTS)
    for item in filter(None, query.split("&")):
        key, sep, value = item.partition("=")
        if not sep or key not in _SPEC_DEFAULTS:
            raise ValueError(f"bad builtin:arithmetic option {item!r}; keys: {sorted(_SPEC_DEFAULTS)}")
        if key == "ops":
            params[key] = value.replace(",", "")
        elif key == "style":
            if value not in STYLES:
                raise ValueError(f"builtin:arithmetic option style must be one of {STYLES}, got {value!r}")
            params[key] = value
        else:
            try:
                params[key] = int(value)
            except ValueError:
                raise ValueError(
                    f"builtin:arithmetic option {key} must be an integer, got {value!r}"
                ) from None
    ops, style = str(params.pop("ops")), str(params.pop("style"))
    return make_arithmetic_prompts(
        int(params["n"]),
        int(params["seed"]),
        min_digits=int(params["min_digits"]),
        max_digits=int(params["max_digits"]),
        ops=tuple(ops),
        style=style,
    )
