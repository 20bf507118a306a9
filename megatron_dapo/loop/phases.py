"""The colocation protocol of the hybrid engine, in one place: which side holds the devices when.

Rank 0's rollout engine and every rank's actor share the devices (`rollout.colocate`). The phases
(loop/colocation.py, also read by the planner): generate (engine awake; the actor's weights, grads
and optimizer state in host memory when actor.offload_when_idle), train (engine released; actor on
device), sync (actor on device, the engine's weights resumed WITHOUT its KV cache, the new weights
streamed from the actor -- gather TP shards, collect PP stages, convert to HF names, tensor by tensor
into the engine, which buckets them for its transport -- then on to generate).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from megatron_dapo import parallel
from megatron_dapo.actor.actor import Actor
from megatron_dapo.loop.colocation import ENGINE_STATE, Phase, phase_model
from megatron_dapo.loop.weight_probe import WeightProbe, WeightSyncError
from megatron_dapo.loop.weight_sync import SyncStats, sync_weights
from megatron_dapo.rollout.base import RolloutEngine
from megatron_dapo.rollout.restarts import stale_engines
from megatron_dapo.rollout.sglang.updates import NodeWeightSync
from megatron_dapo.schedule.pipeline import WeightSnapshot


@dataclass
class Phases:
    """Moves the devices between the rollout engine (driver rank only) and the actor (every rank), as
    the phase model says, and keeps the ledger: at each phase boundary the bytes each side holds on this
    rank's device (`memory/{actor,engine}_bytes_<phase>`; on CUDA also torch's allocated and reserved
    bytes and the device's used memory, `memory/device_{allocated,reserved,used}_<phase>`).

    Every phase change first releases, on every rank, what the new phase does not hold, then waits for all
    ranks (a barrier), then takes what it holds: no actor wakes before the engine's release has returned,
    no KV cache comes back before every actor sleeps. Released engine weights lose their content (CUDA's
    memory saver keeps no copy): the protocol knows it on every rank and syncs before the engine generates
    again. `probe`: checked after every sync (loop/weight_probe.py)."""

    actor: Actor
    engine: RolloutEngine | None
    colocate: bool
    offload_when_idle: bool = True
    probe: WeightProbe | None = None
    weights: NodeWeightSync | None = None
    """This rank's part in updating the SGLang servers (every rank); None: the driver feeds `engine`."""
    lagged: bool = False
    """rollout.lagged: the engine takes host snapshots (take_snapshot); a restarted one takes the last again."""
    restarts: bool = False
    """The run restarts lost engines (rollout.sglang.max_restarts > 0); lagged, it keeps the last snapshot for
    them (one more host copy of the model)."""
    ledger: dict[str, float] = field(default_factory=dict)
    transitions: deque = field(default_factory=lambda: deque(maxlen=64))
    """(time.monotonic(), event) of this rank's last moves: a release when it has returned (actor_slept
    <components>, engine_released <tags>), a retake when it starts (actor_waking <components>,
    engine_resuming <tags>)."""

    def __post_init__(self) -> None:
        self.model = phase_model(colocate=self.colocate, offload_when_idle=self.offload_when_idle)
        self.engine_weights_lost = False
        self.step = 0
        self.resyncs = 0
        self.stale_checks = self.revives = 0
        self._refreshing = threading.Lock()
        self._target: RolloutEngine | None = None  # the driver's engines to refresh (serve)
        self._last_snapshot: WeightSnapshot | None = None  # lagged: the engine's weights (take_snapshot)

    def generate(self) -> None:
        """The engine generates: the actor leaves the device (if offloaded when idle), the engine's
        KV cache (and weights, if still released) come back. Weights released since the last sync are
        synced first."""
        if self.engine_weights_lost:
            self.resyncs += 1
            self.sync(self.step)
            return
        self._enter(self.model["generate"])

    def train(self) -> None:
        """The actor takes the devices: the engine releases its memory."""
        self._enter(self.model["train"])

    def sync(self, step: int) -> SyncStats:
        """The engine's weights (not its KV cache) come back and take the actor's weights, streamed
        (collective over all ranks); the probe is scored by the actor; then on to generate (the actor
        sleeps, the KV cache returns), where the engine scores the probe. A server lost during the sync was
        restarted meanwhile (rollout/engine_group.py): it takes the weights again before the probe."""
        self.step = step
        self._enter(self.model["sync"])
        stats = sync_weights(self.actor.module, self.actor.spec, self.weights or self.engine)
        _attached_took(self.engine)
        for _ in range(_RESYNCS):  # a pass per server lost in the last: each took one restart from the budget
            stale, names = self._stale_after_sync()
            if not names:
                break
            stats = self._sync_to(stale, names)
        else:
            raise WeightSyncError(f"rollout engines {names} still hold stale weights after {_RESYNCS} syncs")
        expected = self.probe.actor_logprobs(self.actor) if self.probe is not None else None
        self.engine_weights_lost = False
        self._last_snapshot = None  # the engine holds these weights, not a snapshot's (lagged: before an evaluation)
        self._enter(self.model["generate"])
        if self.probe is not None:
            self.ledger["rollout/weight_sync_probe_absdiff"] = self.probe.check(self.engine, expected, step)
        return stats

    def snapshot(self, step: int, due: bool = True) -> tuple[SyncStats, WeightSnapshot | None]:
        """rollout.async_steps >= 2 (the engine on its own devices, maybe busy with an older batch): the weights
        after `step` streamed as for a sync (collective over all ranks) into host memory on the rank that
        feeds the engine, the probe scored by the actor; the producer hands them over later (`take_snapshot`).
        `due`: a later batch is due these weights (else nothing is copied; the same on every rank)."""
        self.step = step
        if not due:
            return SyncStats(), None
        self._enter(self.model["sync"])
        feeds = self.engine is not None or self.weights is not None
        snap = WeightSnapshot(step) if feeds else None
        stats = sync_weights(self.actor.module, self.actor.spec, snap)
        expected = self.probe.actor_logprobs(self.actor) if self.probe is not None else None
        if snap is not None:
            snap.expected = expected
        self._enter(self.model["generate"])
        return stats, snap

    def take_snapshot(self, snap: WeightSnapshot) -> None:
        """The producer thread (one rank feeds the engine): the engine takes a snapshot's weights; the probe
        checked on this rank alone. The snapshot is kept for a restarted engine (refresh) until the next."""
        with self._refreshing:
            self._from_snapshot(snap, self.engine)
            self._last_snapshot = snap if self.restarts else None

    def _from_snapshot(self, snap: WeightSnapshot, target: RolloutEngine) -> None:
        """`target` (the engine, or restarted engines of it) takes the snapshot's weights; the probe checked."""
        if self.weights is not None:
            self.weights.only = self._indices(_names(target)) if target is not self.engine else None
            try:
                error = self.weights.update(iter(snap.tensors)).error
            finally:
                self.weights.only = None
            if error is not None:
                raise WeightSyncError(f"the weights after step {snap.version} did not reach the servers: {error}")
        else:
            target.update_weights(snap.tensors)
        if snap.expected is not None:
            diff = self.probe.engine_absdiff(target, snap.expected)
            self.probe.verdict(diff, snap.version)
            self.ledger["rollout/weight_sync_probe_absdiff"] = diff

    def _stale_after_sync(self) -> tuple[RolloutEngine | None, str]:
        """Every rank: the driver's engines that hold stale weights (the driver's; None elsewhere), a server lost in
        the update just made restarted now (revive; an attached one by its own rank, which serves that request while
        it waits here), and their names as the driver says them (host-side; "" when there are none)."""
        stale = None
        if self.engine is not None and self._targeted():
            if hasattr(self.engine, "revive"):
                self.engine.revive(remote=True)
            stale = stale_engines(self.engine)
        self.stale_checks += 1
        return stale, parallel.from_driver(f"stale_engines/{self.stale_checks}", _names(stale))

    def _targeted(self) -> bool:
        """Whether an update can go to some of the engines only (not with the servers' NCCL broadcast group)."""
        return self.weights is None or self.weights.transport != "distributed"

    def can_refresh(self, idle: bool) -> bool:
        """Whether restarted engines can take the current weights mid-rollout (the driver asks): an update can go
        to them alone, and in colocation no engine generates (the actor's weights come back to every device)."""
        return self._targeted() and (idle or not self.colocate)

    def refresh(self, target: RolloutEngine, idle: bool) -> bool:
        """The driver, mid-rollout, any thread: the restarted engines `target` take the actor's weights now,
        every rank taking part (parallel.ask_ranks; the other ranks wait in join_driver) and the probe checked;
        False (nothing done) where it cannot (can_refresh). One refresh at a time."""
        if self.lagged:  # the engine generates on devices of its own, from snapshots: the last one again
            with self._refreshing:
                if self._last_snapshot is None:  # none taken since the start or a direct sync (an evaluation)
                    return False
                self._from_snapshot(self._last_snapshot, target)
            return True
        if not self.can_refresh(idle):
            return False
        with self._refreshing:
            self._target = target
            parallel.ask_ranks(f"refresh_engines {_names(target)}")
        return True

    def serve(self, request: str) -> None:
        """Every rank: a driver's request (parallel.on_driver_request): `refresh_engines <names>` (refresh), or
        `restart_server <url>` (an attached server's restart, by the rank that started it: SGLangServer.restarter)."""
        what, _, names = request.partition(" ")
        if what == "restart_server":
            for server in self.weights.servers if self.weights is not None else []:
                if server.url == names:
                    server.restart()
            parallel.barrier()  # the driver goes on once it answers
            return
        if what != "refresh_engines":
            raise ValueError(f"unknown driver request {request!r}")
        target, self._target = self._target, None
        if self.colocate:
            self._enter(self.model["sync"])
        self._sync_to(target, names)
        expected = self.probe.actor_logprobs(self.actor) if self.probe is not None else None
        if self.colocate:
            self._enter(self.model["generate"])
        if self.probe is not None:
            self.ledger["rollout/weight_sync_probe_absdiff"] = self.probe.check(target, expected, self.step)

    def _sync_to(self, target: RolloutEngine | None, names: str) -> SyncStats:
        """Collective: the actor's weights to the driver's engines `target` (None elsewhere), named `names`, alone:
        with SGLang each rank's part of its node's update, each node posting to those of its servers only."""
        if self.weights is None:
            return sync_weights(self.actor.module, self.actor.spec, target)
        self.weights.only = self._indices(names)
        try:
            stats = sync_weights(self.actor.module, self.actor.spec, self.weights)
        finally:
            self.weights.only = None
        _attached_took(target)
        return stats

    def _indices(self, names: str) -> list[int]:
        """Which of this rank's node sync's servers `names` (urls) name."""
        urls = set(names.split())
        return [k for k, server in enumerate(self.weights.servers) if server.url in urls] if self.weights else []

    def _enter(self, phase: Phase) -> None:
        self._revive()
        moves_engine = self.colocate and self.engine is not None
        released = [t for t in ENGINE_STATE if t not in phase.engine] if self.colocate else []
        if moves_engine and released:
            self.engine.sleep(None if len(released) == len(ENGINE_STATE) else released)
            self._note(f"engine_released {','.join(released)}")
        if "weights" in released:
            self.engine_weights_lost = True
        resident = self.actor.resident()
        if leaving := tuple(c for c in resident if c not in phase.actor):
            self.actor.sleep(leaving)
            self._note(f"actor_slept {','.join(leaving)}")
        if self.colocate:  # the engine shares the devices: nobody retakes memory before all have released
            parallel.barrier()
        if coming := tuple(c for c in phase.actor if c not in resident):
            self._note(f"actor_waking {','.join(coming)}")
            self.actor.wake(coming)
        if moves_engine and phase.engine:
            self._note(f"engine_resuming {','.join(phase.engine)}")
            self.engine.wake(None if set(phase.engine) == set(ENGINE_STATE) else phase.engine)
        self._record(phase)

    def _revive(self) -> None:
        """Servers lost between rollouts are restarted before the engines move or take weights. Another node's
        (attached) is restarted by its own rank: where the servers restart (every rank knows it), the other ranks
        wait for the driver's word meanwhile, serving that request."""
        revive = getattr(self.engine, "revive", None) if self.engine is not None else None
        if self.weights is None or not self.weights.restartable:
            if revive is not None:
                revive()
            return
        if revive is not None:
            revive(remote=True)
        self.revives += 1
        parallel.from_driver(f"revived/{self.revives}", "")

    def _note(self, event: str) -> None:
        self.transitions.append((time.monotonic(), event))

    def _record(self, phase: Phase) -> None:
        name = phase.name
        self.ledger[f"memory/actor_bytes_{name}"] = float(sum(self.actor.device_bytes().values()))
        if self.engine is not None:
            self.ledger[f"memory/engine_bytes_{name}"] = float(sum(self.engine.resident_bytes().values()))
        if name == "generate":
            self.ledger["memory/actor_asleep_in_generate"] = float(self.actor.asleep)
        self.ledger.update(device_memory(name))


def device_memory(phase: str) -> dict[str, float]:
    """On CUDA, what torch allocated and reserved in this process and what the device has in use by every
    process (mem_get_info: what nvidia-smi shows, SGLang servers included), at a phase boundary."""
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {f"memory/device_allocated_{phase}": float(torch.cuda.memory_allocated()),
            f"memory/device_reserved_{phase}": float(torch.cuda.memory_reserved()),
            f"memory/device_used_{phase}": float(total - free)}


def _members(engine: RolloutEngine | None) -> list[RolloutEngine]:
    """The engines `engine` drives: a group's (nested groups too), a wrapper's (ToolEngine.inner), or itself."""
    if engine is None:
        return []
    if isinstance(inner := getattr(engine, "inner", None), RolloutEngine):
        return _members(inner)
    group = getattr(engine, "engines", None)
    return [m for e in group for m in _members(e)] if group is not None else [engine]


def _names(engine: RolloutEngine | None) -> str:
    """Restarted engines as the ranks name them: the servers' urls (every node knows its own), else their kinds."""
    return " ".join(getattr(m, "url", type(m).__name__) for m in _members(engine))


_RESYNCS = 8
"""Syncs of restarted servers in one weight sync, at most (each one lost in the last pass, restarted)."""


def _attached_took(engine: RolloutEngine | None) -> None:
    """The driver, after a sync every rank finished: its attached servers among `engine` took the weights from
    their own nodes (SGLangEngine.took_weights_elsewhere)."""
    for member in _members(engine):
        if getattr(member, "attached", False):
            member.took_weights_elsewhere()  # type: ignore[attr-defined]
