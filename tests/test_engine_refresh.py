"""A restarted rollout engine takes the current weights mid-run (Restarts.refresh; issue 38): a lone engine's groups
wait for it and it generates them itself, in a stream and in rounds; one restarted beside current engines streams
again at once where the run can give it the weights (servers on devices of their own) and from the next rollout where
it cannot (colocated: the others generate on the devices the weights would need); one lost during a weight update is
restarted after it and the phases' sync gives it the weights before the probe; the driver's requests reach every rank
in order, collectives included (parallel.ask_ranks, served in join_driver and from_driver)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from scripted_engines import N, Scripted, drain, expected, request

from megatron_dapo import parallel
from megatron_dapo.loop import phases as phases_mod
from megatron_dapo.loop.colocation import ACTOR_STATE
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.rollout.engine_group import EngineGroup
from megatron_dapo.rollout.group_stream import GroupStream
from megatron_dapo.rollout.restarts import EngineLostError, Restarts
from megatron_dapo.rollout.sglang.updates import NodeWeightSync


class Run:
    """The loop's side of Restarts.refresh: records each call's `idle`, gives the weights where `can(idle)`."""

    def __init__(self, can=lambda idle: True) -> None:
        self.calls: list[bool] = []
        self.can = can

    def __call__(self, engine, idle: bool) -> bool:
        self.calls.append(idle)
        if not self.can(idle):
            return False
        engine.update_weights([])
        return True


def until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_lone_engines_groups_wait_for_it_and_it_streams_them_with_the_current_weights():
    a, run = Scripted(dies_after=2), Run()
    restarts = Restarts(max_restarts=1, refresh=run)
    with EngineGroup([a], names=["a"], restarts=restarts).stream() as stream:
        stream.submit([request(k) for k in range(6)])
        assert drain(stream, 6) == {k: expected(k) for k in range(6)}  # nothing dropped, nothing twice
    assert (a.killed, a.restarted, run.calls, a.stale_weights) == (1, 1, [True], False)  # nothing else generated
    assert a.served == list(range(6)) and restarts.resubmitted_groups == 4


def test_a_lone_engine_the_run_cannot_refresh_stops_the_run_with_one_line():
    a = Scripted(dies_after=1)
    group = EngineGroup([a], names=["http://127.0.0.1:30001"], restarts=Restarts(1, refresh=Run(lambda idle: False)))
    with group.stream() as stream:
        stream.submit([request(k) for k in range(3)])
        with pytest.raises(EngineLostError, match="no other engine holds the current weights") as err:
            drain(stream, 3)
    assert "\n" not in str(err.value) and "http://127.0.0.1:30001" in str(err.value)


def test_rounds_on_a_lone_engine_regenerate_its_chunk_on_it_after_the_restart():
    a, run = Scripted(dies_after=0), Run()
    group = EngineGroup([a], restarts=Restarts(max_restarts=1, refresh=run))
    prompts = [[k + 1, 7] for k in range(4)]
    want = Scripted().generate(prompts, N, SamplingParams(seed=5))
    assert group.generate(prompts, N, SamplingParams(seed=5)) == want  # the same seeds: the same samples
    assert a.restarted == 1 and run.calls == [True] and not a.stale_weights


def test_a_restarted_engine_streams_again_at_once_where_the_run_can_give_it_the_weights():
    a, b, run = Scripted(dies_after=1), Scripted(), Run()  # servers on devices of their own: any time
    with EngineGroup([a, b], names=["a", "b"], restarts=Restarts(max_restarts=1, refresh=run)).stream() as stream:
        stream.submit([request(k) for k in range(4)])
        assert drain(stream, 4) == {k: expected(k) for k in range(4)}
        assert isinstance(stream, GroupStream)
        until(lambda: a.restarted and stream.live(0))
        assert run.calls == [False]  # b generated meanwhile
        stream.submit([request(k) for k in range(4, 12)])
        assert drain(stream, 8) == {k: expected(k) for k in range(4, 12)}
    assert len(a.served) > 1  # it took groups again in the same rollout


def test_colocated_a_restarted_engine_waits_for_the_next_rollout_to_take_the_weights():
    a, b, run = Scripted(dies_after=1), Scripted(), Run(lambda idle: idle)  # the others' devices are busy
    group = EngineGroup([a, b], names=["a", "b"], restarts=Restarts(max_restarts=1, refresh=run))
    with group.stream() as stream:
        stream.submit([request(k) for k in range(6)])
        assert drain(stream, 6) == {k: expected(k) for k in range(6)}
        until(lambda: a.restarted and run.calls)
        assert run.calls == [False] and a.stale_weights and a.served == [0]
    with group.stream() as stream:  # the next rollout: nothing generates yet, so it takes them first
        assert run.calls == [False, True] and not a.stale_weights
        stream.submit([request(k) for k in range(6, 12)])
        assert drain(stream, 6) == {k: expected(k) for k in range(6, 12)}
    assert len(a.served) > 1


class SyncedServer(Scripted):
    """A restartable engine fed by SGLang's node sync (NodeWeightSync's server side); `dies_in_update`: its
    process dies at its first bucket."""

    def __init__(self, url: str, dies_in_update: bool = False) -> None:
        super().__init__()
        self.url = url
        self.cfg, self.dies_in_update, self.buckets = SimpleNamespace(tensor_parallel=1), dies_in_update, 0
        self.weight_groups: list = []

    def weight_problem(self, name, t):
        return None

    def begin_update(self, transport):
        pass

    def end_update(self, transport, failed=False):
        pass

    def post_flat_bucket(self, payloads, version):
        if self.dies_in_update and not self.restarted:
            self.dead = True
            raise RuntimeError("SGLang server exited with code -9 while serving POST /update_weights_from_tensor")
        self.buckets += 1

    def record_update(self, transport, counts):
        self.stale_weights = False


class ResidentActor:
    """An actor that stays on its devices (servers on devices of their own: nothing moves)."""

    module = spec = None
    asleep = False

    def resident(self):
        return ACTOR_STATE

    def device_bytes(self):
        return {}


def test_a_server_lost_during_the_weight_sync_is_restarted_and_takes_the_weights_in_that_sync(monkeypatch):
    a, b = SyncedServer("http://127.0.0.1:30001", dies_in_update=True), SyncedServer("http://127.0.0.1:30002")
    restarts = Restarts(max_restarts=1)
    group = EngineGroup([a, b], names=["a", "b"], restarts=restarts)
    sync = NodeWeightSync.local([a, b], transport="tensor", bucket_bytes=64)
    sync.restartable = True  # rank 0's node
    targets: list[list[int]] = []

    def stream(module, spec, target):
        targets.append(list(range(2)) if target.only is None else list(target.only))
        assert target.update([("w1", torch.ones(4)), ("w2", torch.ones(12))]).error is None
        return phases_mod.SyncStats()

    monkeypatch.setattr(phases_mod, "sync_weights", stream)
    phases = phases_mod.Phases(ResidentActor(), group, colocate=False, weights=sync)  # type: ignore[arg-type]
    phases.sync(1)
    assert targets == [[0, 1], [0]]  # everyone, then the restarted one alone
    assert (a.restarted, a.buckets, b.buckets, restarts.engine_restarts) == (1, 1, 1, 1)  # one bucket each
    assert not a.stale_weights and not b.stale_weights
    phases.sync(2)
    assert targets[2:] == [[0, 1]] and (a.buckets, b.buckets) == (2, 2)


def test_lagged_a_lone_restarted_engine_takes_the_last_snapshot_again():
    """rollout.lagged: the engine generates on devices of its own from host snapshots while the actor trains (no
    collective then): a restarted one takes the last snapshot the engine took; before any, the run stops."""
    from megatron_dapo.schedule.pipeline import WeightSnapshot

    a = Scripted(dies_after=1)
    restarts = Restarts(max_restarts=2)
    group = EngineGroup([a], names=["a"], restarts=restarts)
    phases = phases_mod.Phases(ResidentActor(), group, colocate=False, lagged=True,  # type: ignore[arg-type]
                               restarts=True)
    restarts.refresh = phases.refresh
    taken: list[list[str]] = []

    def update_weights(named):
        taken.append([n for n, _ in named])
        a.stale_weights = False

    a.update_weights = update_weights  # type: ignore[method-assign]
    with group.stream() as stream, pytest.raises(EngineLostError, match="nor can the run give them"):
        stream.submit([request(k) for k in range(3)])
        drain(stream, 3)
    phases.take_snapshot(WeightSnapshot(4, [("w", torch.ones(2))]))
    a.dead, a.dies_after, a.delivered = False, 1, 0  # up again, it dies once more after one group
    with group.stream() as stream:
        stream.submit([request(k) for k in range(3, 6)])
        assert drain(stream, 3) == {k: expected(k) for k in range(3, 6)}
    assert taken == [["w"], ["w"]] and a.restarted == 2 and not a.stale_weights  # taken, then again after the restart


def _asking_rank(rank, world, port, out_dir):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    served = []

    def handler(request_name):
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total)  # a collective, as a weight refresh holds
        served.append((request_name, float(total)))

    parallel.on_driver_request(handler)
    if rank == 0:  # asked from another thread, as a stream's recovery does, while the driver's main thread waits
        time.sleep(0.5)
        def ask():
            for name in ("first", "second"):
                parallel.ask_ranks(name)

        asker = threading.Thread(target=ask)
        asker.start()
        asker.join()
    parallel.join_driver("rollout", poll_s=0.05)
    parallel.join_driver("eval", poll_s=0.05)  # a wait with no request
    if rank == 0:  # a server lost in a weight sync is restarted while the others wait for the driver's word
        parallel.ask_ranks("third")
    said = parallel.from_driver("stale", "a b" if rank == 0 else "")
    dist.barrier()  # rank 0 serves the store: it stays until rank 1 has read its last key
    torch.save((served, said), Path(out_dir) / f"rank_{rank}.pt")
    parallel.destroy()


def test_every_rank_serves_the_drivers_requests_in_order_while_it_waits_for_it(tmp_path):
    from spawn import run_ranks

    run_ranks(_asking_rank, str(tmp_path), nprocs=2, timeout_s=120)
    for rank in (0, 1):
        assert torch.load(tmp_path / f"rank_{rank}.pt") == ([("first", 3.0), ("second", 3.0), ("third", 3.0)], "a b")
