"""Decoders whose batch changes between steps, for the embedded engine's continuous batching.

Both keep the running rows in batch rows 0 .. rows-1 and share one protocol (`RowDecoder`): `admit`
prefills new prompts and appends their sample rows, `step` feeds one token per row, `release` drops
finished rows and says where the others went.

- `SlotDecoder` (Llama / Qwen2 / Qwen3, the fast path's model code): a pool of KV slots
  [slots, Hkv, L, D] in which every row has its own length; a row's token at cache index i has
  position i (no padding), so rows join whenever a slot is free. Releasing moves the last rows into
  the freed slots (one row copy per finished row, not a copy of the whole cache).
- `WaveDecoder` (any other causal LM, through transformers' cache): rows join only when the batch is
  empty, i.e. static batches that still release finished rows and stream groups out as they finish.

The KV budget is in tokens: slots x L <= budget, L = the longest prompt + max_new_tokens submitted.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor
from transformers import PreTrainedModel

from megatron_dapo.rollout.embedded.decoders import HFDecoder, LlamaDecoder


def length_buckets(lengths: Sequence[int]) -> list[list[int]]:
    """Indices of `lengths` in prefill batches, longest first: a batch ends where a length falls to half
    its longest, so padding stays under the batch's real positions (a carried response of 280 tokens
    and fresh prompts of 20 prefill apart, not as 280-wide rows)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    for i in order:
        if buckets and 2 * lengths[i] > lengths[buckets[-1][0]]:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets


class RowDecoder(Protocol):
    rows: int
    """Running rows, in batch rows 0 .. rows-1."""

    @property
    def free(self) -> int:
        """How many rows `admit` may add now."""

    def reserve(self, max_len: int, rows: int) -> None:
        """Room for `rows` running rows of up to `max_len` tokens (prompt + response), budget permitting."""

    def admit(self, prompts: Sequence[Sequence[int]], copies: Sequence[int], record_routes: bool = False) -> Tensor:
        """Prefill each prompt once and append copies[i] rows of prompt i (prompt-major, after the running
        rows); returns the new rows' next-token logits [sum(copies), V]. `record_routes`: keep the new rows'
        routes (a mixture-of-experts model's; `routes`)."""

    def step(self, tokens: Tensor) -> Tensor:
        """Feed one token per running row [rows] -> next-token logits [rows, V]."""

    def release(self, done: Tensor) -> Tensor:
        """Drop the rows where `done` [rows] is set; returns `order`: new row i was row order[i]."""

    def routes(self, row: int) -> Tensor | None:
        """A mixture-of-experts model's routes of running row `row` at every position it read (None: dense)."""


class SlotDecoder(LlamaDecoder):
    """Continuous batching over the model's own Llama-family weights (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, budget_tokens: int) -> None:
        super().__init__(model, 1)
        self.budget = budget_tokens
        self.rows = self.slots = self.length = 0
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.lens = torch.zeros(0, dtype=torch.long, device=self.cos.device)
        self._prefill_kv: list[tuple[Tensor, Tensor]] | None = None
        self._width = 0

    @property
    def free(self) -> int:
        return max(self.slots - self.rows, 0)

    def reserve(self, max_len: int, rows: int) -> None:
        """Room for `rows` rows of up to `max_len` tokens, within the budget (never below the running rows).
        Grows by doubling (lengths by 64-token steps), so a stream reallocates a few times at most."""
        max_len = max(max_len, self.max_len)
        cap = max(self.budget // max_len, self.rows, 1)
        if max_len <= self.max_len and min(rows, cap) <= self.slots:
            return
        max_len = -(-max_len // 64) * 64 if max_len > self.max_len else max_len
        cap = max(self.budget // max_len, self.rows, 1)
        slots = min(cap, max(rows, self.rows, 2 * self.slots if rows > self.slots else self.slots, 1))
        shape = (slots, self.n_kv, max_len, self.head_dim)
        keys = [self.cos.new_zeros(shape) for _ in self.inner.layers]
        values = [self.cos.new_zeros(shape) for _ in self.inner.layers]
        for new, old in zip(keys + values, self.keys + self.values):
            new[: self.rows, :, : old.shape[2]] = old[: self.rows]
        lens = self.lens.new_zeros(slots)
        lens[: self.rows] = self.lens[: self.rows]
        self.keys, self.values, self.lens, self.slots = keys, values, lens, slots
        if max_len > self.max_len:
            self._rope_tables(max_len)

    def admit(self, prompts: Sequence[Sequence[int]], copies: Sequence[int], record_routes: bool = False) -> Tensor:
        device = self.cos.device
        lengths = [len(p) for p in prompts]
        if max(lengths) > self.max_len:
            raise ValueError(f"a prompt of {max(lengths)} tokens does not fit slots of {self.max_len}: "
                             "reserve()")
        if sum(copies) > self.free:
            raise ValueError(f"admit: {sum(copies)} rows, only {self.free} slots free")
        first = [0, *itertools.accumulate(copies)]  # prompt i's new rows: first[i] .. first[i + 1] - 1
        rows, logits = [], []
        for chunk in length_buckets(lengths):
            rows.append(torch.tensor([r for i in chunk for r in range(first[i], first[i + 1])],
                                     device=device))
            logits.append(self._prefill([prompts[i] for i in chunk], [copies[i] for i in chunk], rows[-1]))
        self.rows += first[-1]
        return torch.cat(logits)[torch.cat(rows).argsort()]

    def _prefill(self, prompts: list[Sequence[int]], copies: list[int], at: Tensor) -> Tensor:
        """Prefill `prompts` as one right-padded batch into rows self.rows + at (prompt-major copies);
        returns those rows' next-token logits."""
        device = self.cos.device
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        width = int(lengths.max())
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
        for i, p in enumerate(prompts):  # right-padded: every query sees at least its own prompt
            ids[i, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        pos = torch.arange(width, device=device).expand(len(prompts), width)
        self._prefill_kv = []
        try:
            # Plain causal attention: a real position only sees real ones before it (the padding is at the
            # end); what the padding positions compute is never read (their KV lies beyond the row's length).
            logits = self._forward(ids, pos, None, last=lengths - 1)
            src = torch.arange(len(prompts), device=device).repeat_interleave(
                torch.tensor(copies, device=device))
            dest = self.rows + at
            for layer, (k, v) in enumerate(self._prefill_kv):
                self.keys[layer][dest, :, :width] = k[src]
                self.values[layer][dest, :, :width] = v[src]
        finally:
            self._prefill_kv = None
        self.lens[dest] = lengths[src]
        return logits[src]

    def step(self, tokens: Tensor) -> Tensor:
        pos = self.lens[: self.rows]
        self._width = int(pos.max()) + 1
        keys = torch.arange(self._width, device=pos.device)[None]
        bias = torch.zeros(self.rows, 1, 1, self._width, dtype=self.cos.dtype, device=pos.device)
        bias.masked_fill_((keys > pos[:, None])[:, None, None], float("-inf"))
        logits = self._forward(tokens[:, None], pos[:, None], bias)
        self.lens[: self.rows] += 1
        return logits

    def _store(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self._prefill_kv is not None:  # prefill: attention within the new prompts only
            self._prefill_kv.append((k, v))
            return k, v
        rows = torch.arange(self.rows, device=k.device)
        at = self.lens[: self.rows]
        self.keys[layer][rows, :, at] = k[:, :, 0]
        self.values[layer][rows, :, at] = v[:, :, 0]
        n, w = self.rows, self._width
        return self.keys[layer][:n, :, :w], self.values[layer][:n, :, :w]

    def release(self, done: Tensor) -> Tensor:
        keep = (~done).nonzero().squeeze(1)
        kept = keep.numel()
        order = torch.arange(kept, device=done.device)
        holes = done[:kept].nonzero().squeeze(1)  # freed rows inside the new range ...
        movers = keep[keep >= kept]  # ... take the running rows beyond it
        if holes.numel():
            width = int(self.lens[movers].max())  # the movers' filled part
            for cache in self.keys + self.values:
                cache[holes, :, :width] = cache[movers, :, :width]
            self.lens[holes] = self.lens[movers]
            order[holes] = movers
        self.rows = kept
        return order


class WaveDecoder:
    """Static batches through `HFDecoder` (any causal LM): rows join only when none is running."""

    def __init__(self, model: PreTrainedModel, budget_tokens: int) -> None:
        self.model, self.budget = model, budget_tokens
        self.rows, self.max_len = 0, 1
        self._decoder: HFDecoder | None = None

    @property
    def free(self) -> int:
        return max(self.budget // self.max_len, 1) if self.rows == 0 else 0

    def reserve(self, max_len: int, rows: int) -> None:
        self.max_len = max(self.max_len, max_len)

    def admit(self, prompts: Sequence[Sequence[int]], copies: Sequence[int], record_routes: bool = False) -> Tensor:
        if self.rows:
            raise ValueError("WaveDecoder.admit: rows are still running")
        device = self.model.device
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
        mask = torch.zeros(len(prompts), width, dtype=torch.bool, device=device)
        for i, p in enumerate(prompts):  # left-padded, as the blocking path
            ids[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
            mask[i, width - len(p):] = True
        self._decoder = HFDecoder(self.model, width + self.max_len, record_routes)
        logits = self._decoder.prefill(ids, mask)
        src = torch.repeat_interleave(torch.arange(len(prompts), device=device),
                                      torch.as_tensor(list(copies), device=device))
        self._decoder.select(src)
        self.rows = src.numel()
        return logits[src]

    def step(self, tokens: Tensor) -> Tensor:
        return self._decoder.step(tokens)

    def routes(self, row: int) -> Tensor | None:
        return None if self._decoder is None else self._decoder.routes(row)

    def release(self, done: Tensor) -> Tensor:
        keep = (~done).nonzero().squeeze(1)
        self.rows = keep.numel()
        if self.rows:
            self._decoder.select(keep)
        else:
            self._decoder = None
        return keep
