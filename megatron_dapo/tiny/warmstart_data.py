"""The supervised warm-start data of the tiny base (`megatron_dapo.tiny.base`): answer styles, examples,
batches.

A pretrained base model knows some arithmetic but does not reliably answer in the form the verifier
reads, and sometimes talks past its length budget; DAPO's first gains on a real base come from
fixing exactly that. The tiny base is built the same way: its targets mix four styles, redrawn every
time an example is used, so the model learns the mixture as a habit independent of the question:

    answer    "Answer: 23"                    the form the DAPO reward reads (`arithmetic_target`)
    bare      "23"                            no "Answer:" marker: scored wrong (-1)
    sentence  "The answer is 23"              no marker either: scored wrong
    ramble    "90-67=? 90-67=? Answer: 23"    1-4 echoes of the question, then the answer; with the
                                              tiny config's 24-token budget a long ramble is
                                              truncated (-1) or lands in the soft-overlong zone

Every style states the right number, so what the model learns about arithmetic is shared; which
style it picks is what the reward can teach.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_dapo.data.arithmetic import arithmetic_target, format_answer
from megatron_dapo.data.render import render_prompt_ids
from megatron_dapo.types import Prompt

STYLE_WEIGHTS: dict[str, float] = {"answer": 0.35, "bare": 0.25, "sentence": 0.15, "ramble": 0.25}
"""Probability of each target style in the warm-start data."""
RAMBLE_ECHOES = (1, 2, 3)
"""How many times a "ramble" target echoes the question (drawn uniformly)."""


def style_response(prompt: Prompt, style: str, echoes: int = 1) -> str:
    """The warm-start target text of `prompt` in `style` (see the module docstring)."""
    truth = prompt.ground_truth
    if style == "answer":
        return arithmetic_target(prompt)
    if style == "bare":
        return truth
    if style == "sentence":
        return f"The answer is {truth}"
    if style == "ramble":
        question = prompt.messages[-1]["content"]  # "90-67="
        return f"{question}? " * echoes + format_answer(truth)
    raise ValueError(f"unknown style {style!r}; expected one of {tuple(STYLE_WEIGHTS)}")


@dataclass(frozen=True)
class Example:
    """A prompt's ids and its target ids (each ending in <eos>) for every style variant."""

    prompt_ids: list[int]
    targets: dict[Hashable, list[int]]


def make_examples(tokenizer: Any, prompts: Sequence[Prompt]) -> list[Example]:
    examples = []
    eos = tokenizer.eos_token_id
    for prompt in prompts:
        variants = [(s, 1) for s in STYLE_WEIGHTS if s != "ramble"] + [("ramble", k) for k in RAMBLE_ECHOES]
        targets: dict[Hashable, list[int]] = {
            (s, k): tokenizer.encode(style_response(prompt, s, k), add_special_tokens=False) + [eos]
            for s, k in variants
        }
        examples.append(Example(render_prompt_ids(tokenizer, prompt), targets))
    return examples


def draw_style(rng: random.Random) -> tuple[str, int]:
    style = rng.choices(list(STYLE_WEIGHTS), weights=list(STYLE_WEIGHTS.values()))[0]
    return style, rng.choice(RAMBLE_ECHOES) if style == "ramble" else 1


def collate(rows: Sequence[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt ids, target ids) rows -> right-padded input ids [B, S] and labels [B, S] (-100 on prompt
    and padding: the loss is on the target). With right padding and a causal model no attention mask
    is needed: padding only follows the tokens that count."""
    width = max(len(p) + len(t) for p, t in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for row, (prompt_ids, target_ids) in enumerate(rows):
        ids = prompt_ids + target_ids
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, len(prompt_ids) : len(ids)] = torch.tensor(target_ids)
    return input_ids, labels


def batches(examples: Sequence[Example], batch_size: int, pad_id: int, rng: random.Random,
            draw: Callable[[random.Random], Hashable] = draw_style, pool: int = 1
            ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless shuffled epochs of `examples`, each use with a freshly drawn style (`draw`).

    With `pool` > 1, the rows of `pool` batches at a time are sorted by length and cut into batches
    served in random order (a length-grouped sampler: less padding when target lengths vary widely)."""
    drawn = _row_batches(examples, batch_size, rng, draw)
    while True:
        group = [next(drawn) for _ in range(pool)]
        if pool > 1:
            rows = sorted((r for g in group for r in g), key=lambda r: len(r[0]) + len(r[1]))
            group = [rows[i * batch_size : (i + 1) * batch_size] for i in range(pool)]
            rng.shuffle(group)
        for rows in group:
            yield collate(rows, pad_id)


def _row_batches(examples: Sequence[Example], batch_size: int, rng: random.Random,
                 draw: Callable[[random.Random], Hashable]) -> Iterator[list[tuple[list[int], list[int]]]]:
    order: list[int] = []
    while True:
        if len(order) < batch_size:
            epoch = list(range(len(examples)))
            rng.shuffle(epoch)
            order.extend(epoch)
        picked, order = order[:batch_size], order[batch_size:]
        yield [(examples[i].prompt_ids, examples[i].targets[draw(rng)]) for i in picked]
