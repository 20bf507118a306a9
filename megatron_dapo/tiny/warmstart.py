"""The tiny base's model and its supervised warm-start: `Settings`, `build_model`, `train`.

AdamW, linear warm-up, then cosine decay; the loss is the cross-entropy on the target tokens only
(the data: `warmstart_data`). Training stops at `max_steps` or after `seconds` of wall time, whichever
comes first; the schedule follows whichever budget is further along, so a run cut by the clock still
ends annealed.
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_dapo.tiny.models import tiny_config
from megatron_dapo.tiny.warmstart_data import Example, batches, draw_style


@dataclass(frozen=True)
class Settings:
    """Model size and optimisation of the warm-start (the defaults are the tuned embedded default)."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 64
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 0.01
    warmup_steps: int = 50
    max_steps: int = 1000
    seconds: float = 300.0
    seed: int = 0
    experts: int = 0
    """> 0: a Qwen3-MoE of this many routed experts a layer (top `experts_per_token`, each `intermediate_size`
    wide) instead of the dense Qwen2."""
    experts_per_token: int = 2
    threads: int | None = 1
    """torch intra-op threads while building. One: this model's matrices are too small to gain much
    from a second thread, and on a busy 2-core machine two threads cost several times more (measured:
    ~8x CPU per step under load). None leaves torch's setting."""


def build_model(tokenizer: Any, settings: Settings) -> Any:
    """A randomly initialised float32 Qwen2ForCausalLM (a Qwen3-MoE with `settings.experts`) sized by `settings`
    (uses the global torch RNG)."""
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

    moe = dict(num_experts=settings.experts, num_experts_per_tok=settings.experts_per_token,
               moe_intermediate_size=settings.intermediate_size,
               head_dim=settings.hidden_size // settings.num_heads) if settings.experts else {}
    config = tiny_config(
        "qwen3_moe" if settings.experts else "qwen2",
        tied=False,
        vocab_size=len(tokenizer),
        hidden_size=settings.hidden_size,
        intermediate_size=settings.intermediate_size,
        num_hidden_layers=settings.num_layers,
        num_attention_heads=settings.num_heads,
        num_key_value_heads=settings.num_kv_heads,
        max_position_embeddings=settings.max_position_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **moe,
    )
    model = (AutoModelForCausalLM.from_config(config) if settings.experts else Qwen2ForCausalLM(config)).float()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def lr_factor(step: int, elapsed: float, settings: Settings) -> float:
    """Linear warm-up over `warmup_steps`, then cosine decay to 0.1 over whichever budget binds first.

    Progress is max(step / max_steps, elapsed / seconds), so a run cut by the time limit still ends
    with a decayed learning rate instead of stopping mid-schedule.
    """
    if step < settings.warmup_steps:
        return (step + 1) / settings.warmup_steps
    progress = min(1.0, max(step / settings.max_steps, elapsed / settings.seconds))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class TrainResult:
    steps: int
    seconds: float
    loss: float
    """Mean loss per target token over the last 50 steps."""
    time_limited: bool
    """True when wall time (not the step count) shaped the run: it stopped early or its lr schedule
    was driven by the clock at some step, so the result depends on the machine's speed."""


def train(
    model: Any, examples: Sequence[Example], pad_id: int, settings: Settings, *, progress: bool,
    draw: Callable[[random.Random], Hashable] = draw_style, length_pool: int = 1,
) -> TrainResult:
    """Supervised warm-start (loss on the target tokens only) until max_steps or `seconds` of wall time;
    `draw` picks the target variant (style) of each use of an example, `length_pool` > 1 groups
    batches by length (see `warmstart_data.batches`)."""
    from tqdm import tqdm

    rng = random.Random(settings.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=settings.lr, betas=(0.9, 0.98), weight_decay=settings.weight_decay
    )
    model.train()
    data = batches(examples, settings.batch_size, pad_id, rng, draw, length_pool)
    recent: list[float] = []
    steps, time_limited = 0, False
    start = time.monotonic()
    bar = tqdm(total=settings.max_steps, desc="warm-start", unit="step", disable=not progress, leave=True,
               mininterval=0.1 if sys.stderr.isatty() else 10.0)  # a log file gets a line per 10 s
    with bar:
        while steps < settings.max_steps:
            elapsed = time.monotonic() - start
            if elapsed >= settings.seconds:
                time_limited = True
                break
            clock_ahead = elapsed / settings.seconds > steps / settings.max_steps
            time_limited |= steps >= settings.warmup_steps and clock_ahead  # the clock drives the lr
            for group in optimizer.param_groups:
                group["lr"] = settings.lr * lr_factor(steps, elapsed, settings)
            input_ids, labels = next(data)
            loss = model(input_ids=input_ids, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            steps += 1
            recent = (recent + [loss.item()])[-50:]
            bar.update(1)
            if steps % 10 == 0:
                bar.set_postfix(loss=f"{sum(recent) / len(recent):.3f}")
    model.eval()
    mean_loss = sum(recent) / len(recent) if recent else float("nan")
    return TrainResult(steps, time.monotonic() - start, mean_loss, time_limited)


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run with `n` intra-op threads (None: leave as is), restoring the caller's setting after."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
