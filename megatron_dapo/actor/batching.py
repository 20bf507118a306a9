"""Split a TrainBatch into mini-batches (one optimizer update each) and token-budget micro-batches, per row
or with each group's shared prompt computed once (actor/prefix.py)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_dapo.actor.prefix import PackedRows, Unit, pack_bins, pack_units, prefix_units
from megatron_dapo.types import TrainBatch


@dataclass
class MicroBatch:
    """Rows of a TrainBatch, trimmed to their longest sequence; `rows` index the parent batch. With `packed`,
    the model computes the packed sequences instead and `to_rows` maps its per-token output back."""

    rows: torch.Tensor
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    lengths: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None
    is_weights: torch.Tensor | None = None
    packed: PackedRows | None = None
    response_mask: torch.Tensor | None = None
    """[rows, width] bool: the generated tokens (TrainBatch.generated)."""
    routes: torch.Tensor | None = None
    """[rows, width, layers, top_k]: the routes to replay (TrainBatch.routes)."""
    recorded_routes: torch.Tensor | None = None
    """[rows, width, layers, top_k]: the routes the last forward of this micro-batch took, when recorded."""
    filler: bool = False
    """A stand-in that holds no row of the batch (`rows` is empty): it runs the model's collectives so that
    every expert-parallel rank runs as many micro-batches as the others (filler_micro_batch)."""

    @property
    def shape(self) -> tuple[int, int]:
        """[rows, width] of the per-row tensors."""
        return tuple(self.input_ids.shape)  # type: ignore[return-value]

    @property
    def model_shape(self) -> tuple[int, int]:
        """[sequences, length] the model computes."""
        return tuple(self.model_ids.shape)  # type: ignore[return-value]

    @property
    def model_ids(self) -> torch.Tensor:
        return self.input_ids if self.packed is None else self.packed.input_ids

    def model_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(input_ids, position_ids, attention mask or None = causal) of the sequences the model computes."""
        if self.packed is None:
            return self.input_ids, self.position_ids, None
        return self.packed.input_ids, self.packed.position_ids, self.packed.attention_mask

    @property
    def rotates_by_position_ids(self) -> bool:
        """The model's rotary embedding must read position_ids: a shared-prefix layout's positions are its
        rows' (thd rows restart at 0 where cu_seqlens says, which Megatron's rotary embedding reads)."""
        return self.packed is not None and self.packed.cu_seqlens is None

    def model_kwargs(self, device: torch.device | str) -> dict[str, PackedSeqParams]:
        """The model's keyword arguments beyond model_inputs: Megatron's thd description of rows packed one
        after the other (pack_sequences), on `device`."""
        if self.packed is None or self.packed.cu_seqlens is None:
            return {}
        cu = self.packed.cu_seqlens.to(device)
        longest = int((self.packed.cu_seqlens[1:] - self.packed.cu_seqlens[:-1]).max())
        return {"packed_seq_params": PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                     max_seqlen_q=longest, max_seqlen_kv=longest)}

    def to_rows(self, stats: torch.Tensor) -> torch.Tensor:
        """Per-token statistics of the model's sequences -> [rows, width]."""
        return stats if self.packed is None else self.packed.to_rows(stats)

    @cached_property
    def model_loss_mask(self) -> torch.Tensor:
        """[sequences, length] bool: the model's positions whose statistics are a loss token's (the update
        counts them, then its loss reads them)."""
        return self.model_mask(self.loss_mask > 0)

    def model_response_mask(self) -> torch.Tensor:
        """[sequences, length] bool: the model's positions of generated tokens (TrainBatch.generated)."""
        return self.model_mask(self.response_mask)

    def model_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """A [rows, width] bool mask of the rows' tokens -> the same tokens' positions in the model's
        sequences."""
        if self.packed is None:
            return mask
        flat = torch.zeros(self.packed.input_ids.numel(), dtype=torch.bool)
        flat[self.packed.gather[mask & self.packed.valid]] = True
        return flat.view(self.packed.input_ids.shape)

    def token_counts(self) -> tuple[int, int, int]:
        """(positions the model computes, padding among them, row tokens): row tokens minus the computed
        non-padding ones is what sharing the prompts saved."""
        if self.filler:
            return self.model_shape[1], self.model_shape[1], 0
        rows_total = int(self.lengths.sum())
        computed = self.model_shape[0] * self.model_shape[1]
        real = rows_total if self.packed is None else int(self.packed.real_tokens)
        return computed, computed - real, rows_total


def pack_rows(lengths: list[int], token_budget: int, padded: bool = True) -> list[list[int]]:
    """Group row indices so that the positions computed, rows x longest length (`padded`) or the sum of the
    lengths (packed one after the other), are <= token_budget (a longer row goes alone).

    Rows are taken longest first so that similar lengths share a micro-batch (little padding);
    ties keep the original order, so packing is deterministic.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    packs: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        cost = (len(current) + 1) * longest if padded else sum(lengths[j] for j in current) + lengths[i]
        if current and cost > token_budget:
            packs.append(current)
            current = []
        current.append(i)
    if current:
        packs.append(current)
    return packs


def micro_batches(batch: TrainBatch, token_budget: int, *, shared_prefix: bool = False,
                  pair_cost: float = 0.0, thd: int = 0) -> list[MicroBatch]:
    """Rows packed into micro-batches of <= token_budget computed positions (a longer sequence goes alone).
    `shared_prefix`: the rows of a group are computed as one unit with their common prefix once, and the
    units are packed into sequences as long as the longest one (actor/prefix.py); per row when no group of
    the batch has two rows sharing a token, or where sharing would cost more (`pair_cost`: prefix.py).
    `thd` > 0: the attention takes packed sequences (torch SDPA, TE): per row, a micro-batch's rows go into
    one sequence without padding (pack_sequences, its length a multiple of `thd`); with `thd` = 1 so do the
    units (SDPA computes the block mask as blocks, whatever the sequence's length); 0: a [rows, longest]
    batch, right-padded, and units in sequences as long as the longest one (the dense mask costs L^2)."""
    if shared_prefix:
        units = prefix_units(batch, token_budget, pair_cost)
        if any(len(u.rows) > 1 for u in units):
            lengths = [u.packed_len for u in units]
            micro = [[seq] for seq in pack_rows(lengths, token_budget, padded=False)] if thd == 1 \
                else pack_bins(lengths, token_budget)
            return [_packed_micro_batch(batch, [[units[i] for i in seq] for seq in bins], dense=not thd)
                    for bins in micro]
    lengths = [int(n) for n in batch.lengths.tolist()]
    if thd:
        return [_micro_batch(batch, rows, pack_sequences(batch, rows, thd))
                for rows in pack_rows(lengths, token_budget, padded=False)]
    return [_micro_batch(batch, rows) for rows in pack_rows(lengths, token_budget)]


def filler_micro_batch(multiple: int = 1) -> MicroBatch:
    """A micro-batch of no row: one sequence of token 0s, 2 long (the shortest with a next-token prediction)
    rounded up to a `multiple` (sequence parallelism splits it over the TP ranks), no loss token. Its forward
    and backward take part in the expert-parallel all-to-alls; its loss is 0 times the model's output."""
    n = -(-2 // multiple) * multiple
    zeros = torch.zeros(1, n)
    return MicroBatch(rows=torch.zeros(0, dtype=torch.long), input_ids=torch.zeros(1, n, dtype=torch.long),
                      position_ids=torch.arange(n)[None], lengths=torch.tensor([n]), loss_mask=zeros,
                      advantages=torch.zeros(1), old_logprobs=zeros, response_mask=zeros.bool(), filler=True)


def pack_sequences(batch: TrainBatch, rows: list[int], multiple: int = 1) -> PackedRows:
    """`rows` one after the other in one sequence [1, T], each causal on its own (Megatron's thd format:
    cu_seqlens), each at its own positions 0..n-1; T is padded to a multiple of `multiple` (a sequence of
    padding: sequence parallelism splits T over the tensor-parallel ranks)."""
    lengths = [int(batch.lengths[r]) for r in rows]
    pad = -sum(lengths) % multiple
    spans = lengths + ([pad] if pad else [])
    ids = torch.cat([batch.input_ids[r, :n] for r, n in zip(rows, lengths)]
                    + [batch.input_ids.new_zeros(pad)])
    pos = torch.cat([torch.arange(n) for n in spans])
    cu = torch.tensor([0, *spans], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    width = max(lengths)
    offsets = torch.arange(width)
    gather = (cu[: len(rows), None].long() + offsets).clamp(max=len(ids) - 1)
    valid = offsets[None, :] < torch.tensor(lengths)[:, None]
    return PackedRows(ids[None], pos[None], None, gather, valid, real_tokens=sum(lengths), cu_seqlens=cu)


def _micro_batch(batch: TrainBatch, rows: list[int], packed: PackedRows | None = None) -> MicroBatch:
    idx = torch.tensor(rows, dtype=torch.long)
    width = int(batch.lengths[idx].max())
    ids = batch.input_ids[idx, :width]
    return MicroBatch(
        rows=idx, input_ids=ids, position_ids=torch.arange(width).unsqueeze(0).expand(len(rows), -1),
        lengths=batch.lengths[idx], loss_mask=batch.loss_mask[idx, :width], advantages=batch.advantages[idx],
        old_logprobs=None if batch.old_logprobs is None else batch.old_logprobs[idx, :width],
        is_weights=None if batch.is_weights is None else batch.is_weights[idx, :width], packed=packed,
        response_mask=batch.generated()[idx, :width], routes=None if batch.routes is None else batch.routes[idx, :width])


def _packed_micro_batch(batch: TrainBatch, bins: list[list[Unit]], dense: bool) -> MicroBatch:
    rows = [i for units in bins for u in units for i in u.rows]
    return _micro_batch(batch, rows, pack_units(batch, bins, dense=dense))


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
                      is_weights=pick(batch.is_weights), routes=pick(batch.routes))
