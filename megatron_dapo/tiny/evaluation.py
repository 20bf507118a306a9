"""Evaluation of the tiny base: the validation prompts (`VAL_SPEC`), `transformers` `generate` with greedy
decoding and with plain sampling at temperature 1.0 (no top-k / top-p, `EVAL_SAMPLES` samples per
prompt), at most `MAX_NEW_TOKENS` new tokens (the config's rollout.max_response_len), scored with the
DAPO reward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_dapo.data.render import decode_response, render_prompt_ids
from megatron_dapo.reward.math_dapo import compute_score
from megatron_dapo.types import Prompt

VAL_SPEC = "builtin:arithmetic?n=256&seed=12345"
"""= data.val_path of examples/configs/tiny_cpu.yaml."""
MAX_NEW_TOKENS = 24
"""= rollout.max_response_len of examples/configs/tiny_cpu.yaml."""
EVAL_SAMPLES = 4
"""Samples per validation prompt at temperature 1.0 (= eval.n_samples of the tiny config)."""


@torch.no_grad()
def generate_responses(
    model: Any, tokenizer: Any, prompts: Sequence[Prompt], *, sample: bool, n: int = 1, seed: int = 0,
    max_new_tokens: int = MAX_NEW_TOKENS, lengths: list[int] | None = None,
) -> list[list[str]]:
    """`n` responses per prompt with `model.generate` (greedy, or plain sampling at temperature 1.0);
    `lengths`, if given, receives each response's token count (eos excluded)."""
    rendered = [render_prompt_ids(tokenizer, p) for p in prompts]
    width = max(len(ids) for ids in rendered)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    input_ids = torch.full((len(rendered), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rendered), width), dtype=torch.long)
    for row, ids in enumerate(rendered):  # left padding
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
    kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad)
    if sample:
        kwargs.update(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=n)
    else:
        kwargs.update(do_sample=False)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    responses: list[list[str]] = [[] for _ in prompts]
    for row, seq in enumerate(out[:, width:].tolist()):
        if eos in seq:
            seq = seq[: seq.index(eos)]
        if lengths is not None:
            lengths.append(len(seq))
        responses[row // (n if sample else 1)].append(decode_response(tokenizer, seq))
    return responses


def accuracy(prompts: Sequence[Prompt], responses: Sequence[Sequence[str]]) -> float:
    """Mean DAPO-reward accuracy over every response of every prompt."""
    hits = [compute_score(r, p.ground_truth).acc for p, rs in zip(prompts, responses) for r in rs]
    return sum(hits) / len(hits) if hits else 0.0


def evaluate(model: Any, tokenizer: Any, prompts: Sequence[Prompt], *, seed: int,
             max_new_tokens: int = MAX_NEW_TOKENS, samples: int = EVAL_SAMPLES) -> dict[str, Any]:
    """Greedy and sampled (T=1.0, `samples` per prompt) accuracy, the sampled responses' mean length and
    truncated fraction (at `max_new_tokens`), and a few example responses."""
    greedy = generate_responses(model, tokenizer, prompts, sample=False, max_new_tokens=max_new_tokens)
    lengths: list[int] = []
    sampled = generate_responses(model, tokenizer, prompts, sample=True, n=samples, seed=seed,
                                 max_new_tokens=max_new_tokens, lengths=lengths)
    examples = [
        f"{''.join(m['content'] for m in p.messages)} -> {g[0]!r} (truth {p.ground_truth})"
        for p, g in zip(prompts[:4], greedy[:4])
    ]
    return {
        "greedy_acc": accuracy(prompts, greedy),
        "sampled_acc": accuracy(prompts, sampled),
        "sampled_len_mean": sum(lengths) / max(len(lengths), 1),
        "sampled_truncated": sum(n >= max_new_tokens for n in lengths) / max(len(lengths), 1),
        "examples": examples,
    }
