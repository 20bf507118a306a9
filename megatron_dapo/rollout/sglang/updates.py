"""Weight updates into SGLang servers: into one server (`SGLangEngine.update_weights`), and into all servers
of a node from that node's own trainer ranks (`NodeWeightSync`), so that no weight byte crosses nodes when a
node holds a whole actor replica.

Every rank of a node calls `NodeWeightSync.update` with the same stream of full HF tensors (hf_weight_stream
yields every tensor on every rank) and cuts it into the same buckets. Per bucket, by transport:
- "tensor": SGLang runs server k's TP rank j on GPU k*TP + j (--base-gpu-id k*TP). Colocated, the trainer
  rank on that GPU serialises that server rank's payload from its own device (`payload_plan`, as slime does):
  one flat copy of the bucket, pickled per payload for load_format "flattened_bucket", CUDA tensors named by
  device UUID (transport.py). The node's leader (its lowest rank) gathers the payloads over a gloo group of
  the node and posts one /update_weights_from_tensor per server; every rank keeps its buffer until the
  leader's posts returned (the servers have loaded it), then frees it (torch.cuda.ipc_collect +
  empty_cache). A server rank whose GPU holds no trainer rank (servers on their own GPUs, fewer trainer
  ranks than server GPUs, every CPU server of a one-rank node) is fed from the leader's buffer.
- "distributed": the leader broadcasts each bucket once to all of its node's servers (one group).
- "disk": the leader writes each bucket once into a folder that every server of the node loads.
A failure stops the leader's HTTP calls but not its part in the collectives (it drains the stream): it comes
back in `NodeSyncCounts.error`, for the caller to raise on every rank instead of leaving them waiting. With
`restartable` (rank 0's node, where the engine group restarts lost servers) a server lost mid-update is no error:
it takes no more of this update (`NodeSyncCounts.lost`), and is restarted and given the weights by the caller.
`only` (tensor and disk transports) updates some of the node's servers, the others' parts of the protocol
unchanged: a restarted server takes the current weights while the others generate.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.rollout.sglang.transport import (WeightBroadcastGroup, alongside, flat_bucket,
                                                   flat_payload, release_ipc_memory)
from megatron_dapo.rollout.sglang.wire import iter_buckets, tensor_nbytes

TRANSPORTS = ("tensor", "distributed", "disk")


@dataclass(frozen=True, kw_only=True)
class NodeLayout:
    """One node of the job: its trainer ranks and its SGLang servers."""

    node: int
    ranks: tuple[int, ...]
    """The node's global ranks by local rank; local rank g runs on GPU g (parallel.initialize)."""
    servers: int
    tp: int
    """Each server's tensor-parallel size; server k's TP rank j runs on GPU k*tp + j."""
    colocated: bool

    @property
    def leader(self) -> int:
        return self.ranks[0]


@dataclass(frozen=True)
class Slot:
    """Who serialises the payload of server `server`'s TP rank `tp_rank`: global rank `rank`, from its
    buffer on GPU `gpu` (the UUID of that GPU is what the payload names)."""

    server: int
    tp_rank: int
    rank: int
    gpu: int


def payload_plan(layout: NodeLayout) -> list[Slot]:
    """For every server TP rank of the node: the trainer rank on its GPU when colocated and present, else
    the leader (from the leader's GPU, local rank 0)."""
    slots = []
    for k in range(layout.servers):
        for j in range(layout.tp):
            gpu = k * layout.tp + j
            own = layout.colocated and gpu < len(layout.ranks)
            slots.append(Slot(k, j, layout.ranks[gpu] if own else layout.leader, gpu if own else 0))
    return slots


@dataclass
class NodeSyncCounts:
    tensors: int = 0
    bytes: int = 0
    """Of the stream: one model."""
    sent: int = 0
    """Weight bytes this rank handed to servers: the buckets it copied for them, broadcast or wrote."""
    buckets: int = 0
    seconds: float = 0.0
    error: BaseException | None = None
    lost: list[int] = field(default_factory=list)
    """The node's servers lost during the update (restartable): they took no more of it."""


def bucket_room_problem(bucket: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int) -> Exception | None:
    """On a GPU: its free memory must hold the bucket's flat copy (its gathered tensors are already there);
    checked as the sync phase runs, where the ledger's sizes are known (plan/refit.py sizes it ahead)."""
    device = bucket[0][1].device
    if device.type != "cuda":
        return None
    need = sum(tensor_nbytes(t) for _, t in bucket)
    free = torch.cuda.mem_get_info(device)[0]
    if need <= free:
        return None
    return RuntimeError(f"a weight-sync bucket of {need / 2**30:.2f} GiB does not fit in the "
                        f"{free / 2**30:.2f} GiB free on {device} in the sync phase "
                        f"(rollout.weight_sync_bucket_mb={bucket_bytes // 2**20}): lower it")


class NodeWeightSync:
    """This rank's part in updating its node's servers (`servers`: the leader's SGLangEngines, [] elsewhere).
    `group`: a gloo group of the node's ranks, needed when payloads are gathered (`gathers`)."""

    def __init__(self, servers: Sequence[Any], layout: NodeLayout, rank: int, *, transport: str,
                 bucket_bytes: int, trainer_host: str = "127.0.0.1", group: Any = None,
                 broadcast: WeightBroadcastGroup | None = None, versions: Iterator[int] | None = None
                 ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown weight transport {transport!r} ({', '.join(TRANSPORTS)})")
        self.servers, self.layout, self.rank = list(servers), layout, rank
        self.transport, self.bucket_bytes, self.group = transport, bucket_bytes, group
        self.leader = rank == layout.leader
        if self.leader and len(self.servers) != layout.servers:
            raise ValueError(f"node {layout.node}: {len(self.servers)} servers for a layout of "
                             f"{layout.servers}")
        self.plan = payload_plan(layout)
        self.mine = [s for s in self.plan if s.rank == rank] if transport == "tensor" else []
        self.gathers = transport == "tensor" and any(s.rank != layout.leader for s in self.plan)
        if self.gathers and group is None and len(layout.ranks) > 1:
            raise ValueError("per-rank payloads need a process group of the node's ranks")
        self._broadcast = broadcast
        if transport == "distributed" and self.leader and broadcast is None:
            self._broadcast = WeightBroadcastGroup(self.servers, trainer_host)
            for server in self.servers:
                server.weight_groups.append(self._broadcast)  # left when the server shuts down
        self._versions = versions if versions is not None else itertools.count(1)
        self._staging: dict[str, torch.Tensor] = {}  # this rank's shared-memory bucket buffer (CPU)
        self.restartable = False
        """A server lost mid-update is left out of it, not an error (module docstring)."""
        self.only: list[int] | None = None
        """The servers the next updates go to (None: all of the node's)."""

    @classmethod
    def local(cls, servers: Sequence[Any], *, transport: str, bucket_bytes: int,
              trainer_host: str = "127.0.0.1", broadcast: WeightBroadcastGroup | None = None,
              versions: Iterator[int] | None = None) -> NodeWeightSync:
        """Servers driven by this process alone (no other rank takes part)."""
        layout = NodeLayout(node=0, ranks=(0,), servers=len(servers), tp=servers[0].cfg.tensor_parallel,
                            colocated=False)
        return cls(servers, layout, 0, transport=transport, bucket_bytes=bucket_bytes,
                   trainer_host=trainer_host, broadcast=broadcast, versions=versions)

    def shutdown(self) -> None:
        self._staging.clear()
        if self._broadcast is not None:
            self._broadcast.destroy()

    # ------------------------------------------------------------------------------------------ update

    def update(self, named: Iterable[tuple[str, torch.Tensor]]) -> NodeSyncCounts:
        """Collective over the node's ranks. Never raises for a server's failure: see `error`."""
        counts, t0 = NodeSyncCounts(), time.perf_counter()
        stream = self._counted(named, counts)
        if self.mine or self.gathers:
            self._tensor(stream, counts)
        elif self.leader and self.servers:
            try:
                (self._disk if self.transport == "disk" else self._via_leader)(stream, counts)
            except Exception as e:  # noqa: BLE001 - reported on every rank by the caller
                counts.error = counts.error or e
        for _ in stream:  # drain: the other ranks' collectives go on to the end
            pass
        counts.seconds = time.perf_counter() - t0
        if self.leader:
            for _, server in self._targets(counts):
                server.record_update(self.transport, counts)
        return counts

    def _targets(self, counts: NodeSyncCounts) -> list[tuple[int, Any]]:
        """The servers this update goes to and has not lost, by index."""
        return [(k, s) for k, s in enumerate(self.servers)
                if (self.only is None or k in self.only) and k not in counts.lost]

    def _call(self, counts: NodeSyncCounts, k: int, server: Any, call: Any) -> None:
        """call() for server k; its failure is the update's error, unless the server is lost and restartable."""
        try:
            call()
        except Exception as e:  # noqa: BLE001
            if self.restartable and server.lost() is not None:
                counts.lost.append(k)
            else:
                counts.error = counts.error or e

    def _counted(self, named: Iterable[tuple[str, torch.Tensor]], counts: NodeSyncCounts
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in named:
            counts.tensors += 1
            counts.bytes += tensor_nbytes(t)
            if self.leader and self.servers and counts.error is None:
                problem = self.servers[0].weight_problem(name, t)  # same checkpoint on every server
                if problem is not None:
                    counts.error = problem
            yield name, t

    def _begin(self, counts: NodeSyncCounts) -> str:
        version = str(next(self._versions))
        for k, server in self._targets(counts):
            if counts.error is None:
                self._call(counts, k, server, lambda server=server: server.begin_update(self.transport))
        return version

    def _end(self, counts: NodeSyncCounts) -> None:
        for k, server in self._targets(counts):
            if counts.error is None:
                self._call(counts, k, server, lambda server=server: server.end_update(self.transport))
            else:  # close the session, but report the first error
                with suppress(Exception):
                    server.end_update(self.transport, failed=True)

    def _tensor(self, stream: Iterator[tuple[str, torch.Tensor]], counts: NodeSyncCounts) -> None:
        version = self._begin(counts) if self.leader else ""
        for bucket in iter_buckets(stream, self.bucket_bytes):
            flat, payloads = None, {}
            if self.mine and counts.error is None:
                try:
                    counts.error = bucket_room_problem(bucket, self.bucket_bytes)
                    if counts.error is None:
                        flat, meta = flat_bucket(bucket, self._staging, reserve=self.bucket_bytes)
                        payloads = {(s.server, s.tp_rank): flat_payload(flat, meta) for s in self.mine}
                        counts.sent += sum(tensor_nbytes(t) for _, t in bucket)
                except Exception as e:  # noqa: BLE001 - this rank stops serialising, the protocol goes on
                    counts.error = e
            payloads = self._gather(payloads)
            missing = [s for s in self.plan if (s.server, s.tp_rank) not in payloads]
            if self.leader and missing and counts.error is None:
                slot = missing[0]
                counts.error = RuntimeError(f"rank {slot.rank} sent no payload for server {slot.server}'s TP "
                                            f"rank {slot.tp_rank} (its own error says why)")
            if self.leader and counts.error is None and (targets := self._targets(counts)):
                tp = self.layout.tp
                posts = [lambda k=k, server=server: self._call(counts, k, server, lambda: server.post_flat_bucket(
                    [payloads[(k, j)] for j in range(tp)], version)) for k, server in targets]
                # the servers load at once, each on its own GPUs
                posts[0]() if len(posts) == 1 else alongside(posts, lambda: None)
            if self.gathers and self.group is not None:
                torch.distributed.barrier(group=self.group)  # each buffer is kept until the servers loaded it
            device = bucket[0][1].device
            del flat, payloads
            release_ipc_memory(device)
            counts.buckets += 1
        if self.leader:
            self._end(counts)

    def _gather(self, mine: dict[tuple[int, int], str]) -> dict[tuple[int, int], str]:
        """The leader gets every rank's payloads (a rank that failed sends none: the leader's post fails)."""
        if not self.gathers or self.group is None:
            return mine
        out: list[Any] | None = [None] * len(self.layout.ranks) if self.leader else None
        torch.distributed.gather_object(mine, out, dst=self.layout.leader, group=self.group)
        return {k: v for part in out for k, v in part.items()} if out is not None else {}

    def _via_leader(self, stream: Iterator[tuple[str, torch.Tensor]], counts: NodeSyncCounts) -> None:
        """distributed: one broadcast of each bucket to every server of the node."""
        assert self._broadcast is not None
        try:
            self._broadcast.ensure()
        except Exception as e:  # noqa: BLE001
            counts.error = e
            return
        version = self._begin(counts)
        try:
            for bucket in iter_buckets(stream, self.bucket_bytes):
                if counts.error is None:
                    self._broadcast.send(bucket, version)
                    counts.sent += sum(tensor_nbytes(t) for _, t in bucket)
                counts.buckets += 1
        except Exception as e:  # noqa: BLE001
            counts.error = e
        self._end(counts)

    def _disk(self, stream: Iterator[tuple[str, torch.Tensor]], counts: NodeSyncCounts) -> None:
        """disk: the buckets as safetensors shards in one folder, loaded by every server of the node."""
        from safetensors.torch import save_file

        version = self._begin(counts)
        first = self.servers[0]
        folder = Path(tempfile.mkdtemp(prefix="weights-", dir=first.log_path.parent))
        try:
            for name in ("config.json", "generation_config.json"):
                if (Path(first.model_path) / name).exists():
                    shutil.copy(Path(first.model_path) / name, folder / name)
            for i, bucket in enumerate(iter_buckets(stream, self.bucket_bytes)):
                if counts.error is None:
                    save_file({n: t.detach().to("cpu").contiguous().clone() for n, t in bucket},
                              str(folder / f"bucket-{i:05d}.safetensors"))
                    counts.sent += sum(tensor_nbytes(t) for _, t in bucket)
                counts.buckets += 1
            for k, server in self._targets(counts) if counts.tensors and counts.error is None else []:
                self._call(counts, k, server, lambda server=server: server.load_from_disk(folder, version))
        except Exception as e:  # noqa: BLE001
            counts.error = counts.error or e
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self._end(counts)
