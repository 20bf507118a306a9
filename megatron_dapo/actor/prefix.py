"""Shared-prefix packing (actor.shared_prefix): the rows of a group share their prompt, so the prompt is
computed once and every response attends to its keys and values.

A unit (a group, or part of one that fits the token budget) whose rows share their first c tokens becomes
one sequence: the prefix (tokens 0..c-2) followed by one segment per row, each the row's token c-1 and
everything after it. Each segment attends causally to the prefix and to itself only, and its positions
continue at c-1, so every position sees exactly the keys, values and rotary positions it sees in its own
row: the computation is exact. Copying token c-1 into each segment (one extra token per row) keeps
"position p predicts the token at p+1" true inside every segment, so the logprob kernels run unchanged on
the packed sequence and `gather` maps their output back to the per-row layout: row position t < c reads
the prefix (t = c-1: the first segment's copy, whose predecessor is the prefix's last token), t >= c its
own segment. Several units can share one sequence (each sees its own positions only), which leaves little
padding: `pack_bins`.

Cost: Megatron's local attention is a dense masked softmax (the SDPA one computes `AttentionBlocks` instead,
only the pairs the mask keeps, padded per block set), length^2 per sequence with the masked pairs, so a
sequence of G long responses behind a short prompt can cost up to G times the G samples' attention, while
every other layer computes fewer positions. A group's rows are shared only where that pays:
L + pair_cost x L^2 for the packed unit at most the sum over its rows (`pair_cost`: one query-key pair's
attention FLOPs over one token's linear FLOPs, ModelSpec.attention_pair_cost).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from megatron_dapo.types import TrainBatch


@dataclass(frozen=True)
class Unit:
    """Batch rows computed as one packed sequence; `shared` leading tokens are common to all of them."""

    rows: tuple[int, ...]
    lengths: tuple[int, ...]
    shared: int

    @property
    def packed_len(self) -> int:
        """The prefix (shared - 1 tokens) plus one segment (its copy of token shared-1, then the rest) per row."""
        return self.shared - 1 + sum(n - self.shared + 1 for n in self.lengths)

    @staticmethod
    def alone(row: int, length: int) -> Unit:
        """A row by itself: the packed sequence is the row."""
        return Unit((row,), (length,), length)


@dataclass
class AttentionBlocks:
    """Blocks of queries of the packed sequences, padded to one size: a block's queries attend to all of its
    context and causally to themselves, which is the block mask restricted to them (a unit's prefix: no
    context; a segment: its prefix). Indices are flat into [P * L]. The dense mask costs L^2 pairs per
    sequence; the blocks cost the prefix's own causal square plus each segment x (prefix + segment)."""

    queries: torch.Tensor
    """[n, r] int64 (padding: 0)."""
    keys: torch.Tensor
    """[n, c + r] int64: the context's positions (padded to c), then the block's own (padded to r)."""
    visible: torch.Tensor
    """[n, 1, r, c + r] bool, True = attended; a padding query sees key 0 only (finite, discarded)."""
    valid: torch.Tensor
    """[n, r] bool: the block's real queries."""

    @staticmethod
    def of(blocks: list[tuple[torch.Tensor, torch.Tensor]]) -> AttentionBlocks:
        """From (context, own) flat index lists."""
        r, c = max(len(own) for _, own in blocks), max(len(ctx) for ctx, _ in blocks)
        n = len(blocks)
        queries, keys = torch.zeros(n, r, dtype=torch.long), torch.zeros(n, c + r, dtype=torch.long)
        visible, valid = torch.zeros(n, 1, r, c + r, dtype=torch.bool), torch.zeros(n, r, dtype=torch.bool)
        for i, (ctx, own) in enumerate(blocks):
            m, k = len(own), len(ctx)
            queries[i, :m], valid[i, :m], keys[i, :k], keys[i, c : c + m] = own, True, ctx, own
            visible[i, 0, :m, :k] = True
            visible[i, 0, :m, c : c + m] = torch.ones(m, m, dtype=torch.bool).tril()
            visible[i, 0, m:, 0] = True
        return AttentionBlocks(queries, keys, visible, valid)

    def to(self, device: torch.device) -> AttentionBlocks:
        return AttentionBlocks(*(t.to(device) for t in (self.queries, self.keys, self.visible, self.valid)))


def blocks_of(unit_of: torch.Tensor, seg: torch.Tensor) -> list[AttentionBlocks]:
    """The blocks of [P, L] packed sequences (`unit_of`, `seg` as block_mask takes them per sequence): the
    prefixes in one padded set, the segments in another (their sizes differ)."""
    width = unit_of.shape[1]
    prefixes, segments = [], []
    for p in range(unit_of.shape[0]):
        for k in unit_of[p].unique().tolist():
            if k < 0:
                continue
            mine = unit_of[p] == k
            prefix = torch.nonzero(mine & (seg[p] == 0)).flatten() + p * width
            if len(prefix):
                prefixes.append((prefix[:0], prefix))
            for j in seg[p][mine & (seg[p] > 0)].unique().tolist():
                segments.append((prefix, torch.nonzero(mine & (seg[p] == j)).flatten() + p * width))
    return [AttentionBlocks.of(b) for b in (prefixes, segments) if b]


@dataclass
class PackedRows:
    """The model's view of a micro-batch of units: P sequences of one or more units each, right-padded to L."""

    input_ids: torch.Tensor
    """[P, L] int64."""
    position_ids: torch.Tensor
    """[P, L] int64: each token's position in its own row (the rotary positions)."""
    attention_mask: torch.Tensor | None
    """[P, 1, L, L] bool, True = masked (Megatron's convention); None: `blocks` only, or `cu_seqlens`."""
    gather: torch.Tensor
    """[n, width] int64: for row j's position t, the flat index into [P * L] of the packed position whose
    per-token statistics (logprob of token t, entropy at t-1) are those of row j at t."""
    valid: torch.Tensor
    """[n, width] bool: t < length of row j (the rest is the row's padding and reads as 0)."""
    real_tokens: int
    """Positions of the packed sequences that are not padding."""
    blocks: list[AttentionBlocks] = field(default_factory=list)
    """The block mask as independent blocks of queries (the SDPA core attention computes only these pairs)."""
    cu_seqlens: torch.Tensor | None = None
    """[k + 1] int32: one sequence [1, L] of k causal sequences one after the other, none seeing another
    (Megatron's thd format, actor/batching.py's pack_sequences); None: the block mask."""

    def to_rows(self, stats: torch.Tensor) -> torch.Tensor:
        """[P, L] per-token statistics of the packed sequences -> [n, width] per row (differentiable). A row's
        position 0 reads 0, as in a row of its own: the packed position before it is another unit's."""
        picked = stats.reshape(-1)[self.gather.to(stats.device)]
        return torch.where(self._read.to(stats.device), picked, picked.new_zeros(()))

    @cached_property
    def _read(self) -> torch.Tensor:
        """`valid` without position 0: computed once, read by every statistic mapped back."""
        read = self.valid.clone()
        read[:, 0] = False
        return read


def common_prefix(ids: torch.Tensor) -> int:
    """The number of leading tokens all rows of `ids` [n, m] have in common."""
    differs = (ids != ids[:1]).any(0).nonzero()
    return int(differs[0]) if len(differs) else int(ids.shape[1])


def group_rows(batch: TrainBatch) -> list[list[int]]:
    """Rows of the same prompt, in order of first appearance: by `prompt_index`; without it, by identical
    prompt tokens (those before the first generated token of `response_mask`); without either, each row
    alone (nothing is known to be shared)."""
    n = len(batch)
    if batch.prompt_index is not None:
        keys: list[object] = batch.prompt_index.tolist()
    elif batch.response_mask is not None:
        starts = [int(r.nonzero()[0]) if r.any() else int(length) for r, length in
                  zip(batch.response_mask, batch.lengths.tolist())]
        keys = [tuple(batch.input_ids[i, :s].tolist()) for i, s in enumerate(starts)]
    else:
        keys = list(range(n))
    groups: dict[object, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def prefix_units(batch: TrainBatch, token_budget: int, pair_cost: float = 0.0) -> list[Unit]:
    """Every row in exactly one unit. A group's rows share their longest common prefix (at least the
    prompt); a group longer than `token_budget` packed is split into consecutive units that fit (a unit
    holds one row at least); a unit that would cost more than its rows apart (module docstring) is split
    into its rows."""
    lengths = [int(n) for n in batch.lengths.tolist()]
    units: list[Unit] = []
    for rows in group_rows(batch):
        shortest = min(lengths[i] for i in rows)
        shared = common_prefix(batch.input_ids[rows, :shortest]) if len(rows) > 1 else 0
        if shared == 0:
            units += [Unit.alone(i, lengths[i]) for i in rows]
            continue
        for unit in _split(rows, lengths, shared, token_budget):
            pays = _cost(unit.packed_len, pair_cost) <= sum(_cost(n, pair_cost) for n in unit.lengths)
            units += [unit] if pays else [Unit.alone(i, n) for i, n in zip(unit.rows, unit.lengths)]
    return units


def _cost(length: int, pair_cost: float) -> float:
    return length + pair_cost * length * length


def _split(rows: list[int], lengths: list[int], shared: int, token_budget: int) -> list[Unit]:
    out: list[Unit] = []
    current: list[int] = []
    for i in rows:
        trial = Unit(tuple(current + [i]), tuple(lengths[j] for j in current + [i]), shared)
        if current and trial.packed_len > token_budget:
            out.append(Unit(tuple(current), tuple(lengths[j] for j in current), shared))
            current = []
        current.append(i)
    out.append(Unit(tuple(current), tuple(lengths[j] for j in current), shared))
    return [u if len(u.rows) > 1 else Unit.alone(u.rows[0], u.lengths[0]) for u in out]


@dataclass
class _Layout:
    tokens: torch.Tensor
    positions: torch.Tensor
    segments: torch.Tensor
    """0 = the prefix, k = row k's segment (1-based)."""
    index: list[torch.Tensor]
    """Per row: packed position of each of its positions 0..length-1."""


def _layout(unit: Unit, ids: torch.Tensor) -> _Layout:
    c = unit.shared
    tokens, positions = [ids[unit.rows[0], : c - 1]], [torch.arange(c - 1)]
    segments, index = [torch.zeros(c - 1, dtype=torch.long)], []
    start = c - 1
    for k, (row, n) in enumerate(zip(unit.rows, unit.lengths), 1):
        size = n - c + 1
        tokens.append(ids[row, c - 1 : n])
        positions.append(torch.arange(c - 1, n))
        segments.append(torch.full((size,), k, dtype=torch.long))
        index.append(torch.cat([torch.arange(c), start + torch.arange(1, size)]))
        start += size
    return _Layout(torch.cat(tokens), torch.cat(positions), torch.cat(segments), index)


def pack_bins(lengths: list[int], token_budget: int) -> list[list[list[int]]]:
    """Micro-batches of sequences of units (indices into `lengths`): units are taken longest first and each
    goes into the first sequence of the current micro-batch with room for it; a micro-batch's sequences are
    as long as its longest unit (so no sequence is longer than with one unit each: the dense attention
    costs no more per sequence) and there are at most max(1, token_budget // that) of them."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    micro: list[list[list[int]]] = []
    bins: list[list[int]] = []
    free: list[int] = []
    width = 0
    for i in order:
        fit = next((b for b, room in enumerate(free) if lengths[i] <= room), None)
        if fit is None:
            if bins and (len(bins) + 1) * width > token_budget:
                micro.append(bins)
                bins, free = [], []
            if not bins:
                width = lengths[i]
            bins.append([])
            free.append(width)
            fit = len(bins) - 1
        bins[fit].append(i)
        free[fit] -= lengths[i]
    if bins:
        micro.append(bins)
    return micro


def block_mask(units: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """[L, L] bool, True = masked, for a sequence whose position p belongs to unit units[p] (-1 = padding)
    and segment segments[p] of it (0 = its prefix): causal, and a query sees its own unit's prefix and its
    own segment only (padding sees padding)."""
    causal = torch.ones(len(units), len(units), dtype=torch.bool).tril()
    same_unit = units[None, :] == units[:, None]
    visible = (segments[None, :] == 0) | (segments[None, :] == segments[:, None])
    return ~(causal & same_unit & visible)


def pack_units(batch: TrainBatch, bins: list[list[Unit]], pad_id: int = 0, dense: bool = True) -> PackedRows:
    """One sequence per bin (its units one after the other, then padding) and the map back to the rows,
    in bin and unit order. `dense`: with the [P, 1, L, L] block mask (Megatron's attention reads it; SDPA
    computes the blocks)."""
    layouts = [[_layout(u, batch.input_ids) for u in units] for units in bins]
    width = max(sum(len(lay.tokens) for lay in lays) for lays in layouts)
    lengths = [n for units in bins for u in units for n in u.lengths]
    ids = torch.full((len(bins), width), pad_id, dtype=torch.long)
    pos = torch.zeros(len(bins), width, dtype=torch.long)
    unit_of = torch.full((len(bins), width), -1, dtype=torch.long)
    seg = torch.full((len(bins), width), -1, dtype=torch.long)
    gather = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    j = 0
    for p, lays in enumerate(layouts):
        start = 0
        for k, lay in enumerate(lays):
            span = slice(start, start + len(lay.tokens))
            ids[p, span], pos[p, span], seg[p, span] = lay.tokens, lay.positions, lay.segments
            unit_of[p, span] = k
            for idx in lay.index:
                gather[j, : len(idx)] = p * width + start + idx
                j += 1
            start += len(lay.tokens)
    valid = torch.arange(gather.shape[1])[None, :] < torch.tensor(lengths)[:, None]
    mask = torch.stack([block_mask(u, s) for u, s in zip(unit_of, seg)]).unsqueeze(1) if dense else None
    return PackedRows(ids, pos, mask, gather, valid, real_tokens=int((unit_of >= 0).sum()),
                      blocks=blocks_of(unit_of, seg))
