"""Split a TrainBatch into mini-batches (one optimizer update each) and token-budget micro-batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_dapo.types import TrainBatch


@dataclass
class MicroBatch:
    """Rows of a TrainBatch, trimmed to their longest sequence; `rows` index the parent batch."""

    rows: torch.Tensor
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None
    is_weights: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]


def pack_rows(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Group row indices so that rows x longest length <= token_budget (a longer row goes alone).

    Rows are taken longest first so that similar lengths share a micro-batch (little padding);
    ties keep the original order, so packing is deterministic.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    packs: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        if current and (len(current) + 1) * longest > token_budget:
            packs.append(current)
            current = []
        current.append(i)
    if current:
        packs.append(current)
    return packs


def micro_batches(batch: TrainBatch, token_budget: int) -> list[MicroBatch]:
    lengths = [int(n) for n in batch.lengths.tolist()]
    out = []
    for rows in pack_rows(lengths, token_budget):
        idx = torch.tensor(rows, dtype=torch.long)
        width = max(lengths[i] for i in rows)
        ids = batch.input_ids[idx, :width]
        out.append(MicroBatch(
            rows=idx, input_ids=ids,
            position_ids=torch.arange(width).unsqueeze(0).expand(len(rows), -1),
            loss_mask=batch.loss_mask[idx, :width], advantages=batch.advantages[idx],
            old_logprobs=None if batch.old_logprobs is None else batch.old_logprobs[idx, :width],
            is_weights=None if batch.is_weights is None else batch.is_weights[idx, :width]))
    return out


def split_rows(batch: TrainBatch, num_parts: int) -> list[TrainBatch]:
    """Contiguous, equal mini-batches of rows (the trainer keeps whole groups together)."""
    n = len(batch)
    if num_parts < 1 or n % num_parts:
        raise ValueError(f"{n} rows cannot be split into {num_parts} equal mini-batches")
    size = n // num_parts
    return [select_rows(batch, torch.arange(k * size, (k + 1) * size)) for k in range(num_parts)]


def select_rows(batch: TrainBatch, idx: torch.Tensor) -> TrainBatch:
    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[idx]

    return TrainBatch(input_ids=batch.input_ids[idx], loss_mask=batch.loss_mask[idx],
                      advantages=batch.advantages[idx], lengths=batch.lengths[idx],
                      old_logprobs=pick(batch.old_logprobs), rollout_logprobs=pick(batch.rollout_logprobs),
                      prompt_index=pick(batch.prompt_index), response_mask=pick(batch.response_mask),
                      is_weights=pick(batch.is_weights))
