"""Getting the driver's train batch to the ranks that train on it: each data-parallel rank receives only its
rows, as tensors, and shares them with the tensor/pipeline peers of its replica. Pure transport: the
driver built the batch (train.py; the advantages need whole groups, `trainable` trims them to whole
mini-batches on every DP rank).

The driver splits the rows into DP contiguous, equal shares. A small header goes to every rank (the
shares' shape); then share d goes point to point to the first rank of DP replica d, which broadcasts it
inside its model-parallel group. Every share has the batch's width, so each rank receives total / DP
bytes (plus the header).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_dapo import parallel
from megatron_dapo.actor.batching import split_rows
from megatron_dapo.types import Group, TrainBatch


@dataclass
class Transfer:
    """What one scatter moved."""

    bytes_total: int = 0
    """Bytes of the step's training rows, all shares (driver only; 0 elsewhere)."""
    bytes_received: int = 0
    """Bytes this rank received (header + its share; 0 on the driver)."""

    def scalars(self) -> dict[str, float]:
        """perf/rollout_bytes_total and perf/rollout_bytes_max_recv (the most any rank received: a collective)."""
        return {"perf/rollout_bytes_total": float(self.bytes_total),
                "perf/rollout_bytes_max_recv": float(max_received(self))}


def trainable(groups: list[Group], num_mini_batches: int) -> list[Group]:
    """Trim a (partial) batch to whole mini-batches that split evenly over DP ranks."""
    unit = parallel.dp_size() * num_mini_batches
    return groups[: len(groups) // unit * unit]


ROUTE_DTYPES = (torch.uint8, torch.int16)
"""The dtypes rollout routes travel in (types.route_dtype), by their header code 1, 2 (0: no routes)."""


def pack(batch: TrainBatch) -> list[torch.Tensor]:
    """The rows as four tensors: token ids (int32), [3, B, S] fp32 (loss mask, rollout logprobs,
    response mask), advantages [B] fp32, [2, B] int64 (lengths, prompt index); a fifth, the rollout's routes
    [B, S, layers, k] in their small integer dtype, when the batch has them (r3)."""
    parts = [batch.input_ids.to(torch.int32),
             torch.stack([batch.loss_mask, batch.rollout_logprobs, batch.response_mask]).float(),
             batch.advantages.float(), torch.stack([batch.lengths, batch.prompt_index]).long()]
    return parts + ([] if batch.routes is None else [batch.routes.contiguous()])


def unpack(parts: list[torch.Tensor]) -> TrainBatch:
    ids, floats, adv, ints, *routes = parts
    return TrainBatch(input_ids=ids.long(), loss_mask=floats[0], rollout_logprobs=floats[1],
                      response_mask=floats[2], advantages=adv, lengths=ints[0], prompt_index=ints[1],
                      routes=routes[0] if routes else None)


def header_of(parts: list[torch.Tensor]) -> torch.Tensor:
    """What the receivers allocate: rows, width, and the routes' layers, top-k and dtype code (0s: none)."""
    rows, width = parts[0].shape
    if len(parts) < 5:
        return torch.tensor([rows, width, 0, 0, 0], dtype=torch.long)
    routes = parts[4]
    return torch.tensor([rows, width, routes.shape[2], routes.shape[3], 1 + ROUTE_DTYPES.index(routes.dtype)])


def empty_parts(header: list[int]) -> list[torch.Tensor]:
    rows, width, layers, k, code = header
    parts = [torch.empty(rows, width, dtype=torch.int32), torch.empty(3, rows, width),
             torch.empty(rows), torch.empty(2, rows, dtype=torch.long)]
    return parts + ([torch.empty(rows, width, layers, k, dtype=ROUTE_DTYPES[code - 1])] if code else [])


def nbytes(parts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in parts)


def scatter(batch: TrainBatch | None) -> tuple[TrainBatch | None, Transfer]:
    """Collective over all ranks; `batch` on the driver only (None there: the step trains nothing).
    Returns this rank's rows (None everywhere when the driver has none) and what moved."""
    shares = [pack(s) for s in split_rows(batch, parallel.dp_size())] if batch is not None else []
    total = sum(map(nbytes, shares))
    if parallel.world_size() == 1:
        return (unpack(shares[0]) if shares else None), Transfer(bytes_total=total)
    header = header_of(shares[0]) if shares else torch.zeros(5, dtype=torch.long)
    dist.broadcast(header, src=0)
    received = 0 if parallel.is_main() else header.numel() * header.element_size()
    if not header[0]:
        return None, Transfer(bytes_received=received)
    mine = _deliver(shares, header.tolist())
    received += 0 if parallel.is_main() else nbytes(mine)
    return unpack(mine), Transfer(bytes_total=total, bytes_received=received)


def _deliver(shares: list[list[torch.Tensor]], header: list[int]) -> list[torch.Tensor]:
    """The driver sends share d to the first rank of DP replica d; that rank broadcasts it to its
    model-parallel peers. Returns this rank's share."""
    me = parallel.global_rank()
    mp_ranks = dist.get_process_group_ranks(parallel.mp_group())
    leaders = [torch.zeros(2, dtype=torch.long) for _ in range(parallel.world_size())]
    dist.all_gather(leaders, torch.tensor([parallel.dp_rank(), min(mp_ranks)]))  # (dp rank, its first rank)
    if me == 0:
        first = {int(d): int(r) for d, r in (t.tolist() for t in leaders)}
        for d, share in enumerate(shares[1:], start=1):
            for t in share:
                dist.send(t.contiguous(), dst=first[d])
        parts = shares[0]
    else:
        parts = empty_parts(header)
        if me == min(mp_ranks):
            for t in parts:
                dist.recv(t, src=0)
    if len(mp_ranks) > 1:
        for t in parts:
            dist.broadcast(t, src=min(mp_ranks), group=parallel.mp_group())
    return parts


def max_received(moved: Transfer) -> int:
    """The most bytes any rank received in this transfer (a collective)."""
    if parallel.world_size() == 1:
        return 0
    t = torch.tensor([moved.bytes_received], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)
