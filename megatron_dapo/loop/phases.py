"""The colocation protocol of the hybrid engine, in one place: which side holds the devices when.

Rank 0's rollout engine and every rank's actor share the devices (`rollout.colocate`). The phases
(loop/phase_model.py, also read by the planner): generate (engine awake; the actor's weights, grads
and optimizer state in host memory when actor.offload_when_idle), train (engine released; actor on
device), sync (actor on device, the engine's weights resumed WITHOUT its KV cache, the new weights
streamed from the actor -- gather TP shards, collect PP stages, convert to HF names, tensor by tensor
into the engine, which buckets them for its transport -- then on to generate).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_dapo.actor.actor import Actor
from megatron_dapo.loop.phase_model import ENGINE_STATE, Phase, phase_model
from megatron_dapo.loop.weight_sync import SyncStats, sync_weights
from megatron_dapo.rollout.base import RolloutEngine


@dataclass
class Phases:
    """Moves the devices between the rollout engine (driver rank only) and the actor (every rank), as
    the phase model says, and keeps the ledger: at each phase boundary the bytes each side holds on this
    rank's device (`memory/{actor,engine}_bytes_<phase>`; on CUDA also `memory/device_allocated_<phase>`,
    torch's count for this process, which holds the actor and an in-process engine)."""

    actor: Actor
    engine: RolloutEngine | None
    colocate: bool
    offload_when_idle: bool = True
    ledger: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.model = phase_model(colocate=self.colocate, offload_when_idle=self.offload_when_idle)

    def generate(self) -> None:
        """The engine generates: the actor leaves the device (if offloaded when idle), the engine's
        KV cache (and weights, if still released) come back."""
        phase = self.model["generate"]
        self._actor_to(phase)
        self._engine_to(phase)
        self._record(phase)

    def train(self) -> None:
        """The actor takes the devices: the engine releases its memory."""
        phase = self.model["train"]
        self._engine_to(phase)
        self._actor_to(phase)
        self._record(phase)

    def sync(self) -> SyncStats:
        """The engine's weights (not its KV cache) come back and take the actor's weights, streamed
        (collective over all ranks); then on to generate: the actor sleeps, the KV cache returns."""
        phase = self.model["sync"]
        self._actor_to(phase)
        self._engine_to(phase)
        stats = sync_weights(self.actor.module, self.actor.spec, self.engine)
        self._record(phase)
        self.generate()
        return stats

    def _actor_to(self, phase: Phase) -> None:
        if phase.actor_on_device:
            self.actor.wake()
        else:
            self.actor.sleep()

    def _engine_to(self, phase: Phase) -> None:
        if self.engine is None or not self.colocate:
            return  # not on the actor's devices: never moved
        if phase.engine:
            self.engine.wake(None if set(phase.engine) == set(ENGINE_STATE) else phase.engine)
        released = [t for t in ENGINE_STATE if t not in phase.engine]
        if released:
            self.engine.sleep(None if len(released) == len(ENGINE_STATE) else released)

    def _record(self, phase: Phase) -> None:
        name = phase.name
        self.ledger[f"memory/actor_bytes_{name}"] = float(sum(self.actor.device_bytes().values()))
        if self.engine is not None:
            self.ledger[f"memory/engine_bytes_{name}"] = float(sum(self.engine.resident_bytes().values()))
        if name == "generate":
            self.ledger["memory/actor_asleep_in_generate"] = float(self.actor.asleep)
        if torch.cuda.is_available():
            self.ledger[f"memory/device_allocated_{name}"] = float(torch.cuda.memory_allocated())
