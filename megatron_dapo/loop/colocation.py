"""The colocation protocol as data: which components of each side are on the device in each phase.

The trainer (loop/phases.py) moves the actor and the rollout engine to match it and records what they
really hold (the phase ledger); the planner (megatron_dapo.plan) sizes each phase from the same table.
So plan and trainer cannot disagree about what shares a GPU when. Plain data: no torch, no Megatron.

    generate  the engine generates (weights + KV cache); the actor is offloaded when
              actor.offload_when_idle (else its state stays resident)
    train     pi_old and the updates: the actor's state + activations; the engine has released all
    sync      the engine's weights are back (its KV cache not yet) and take the actor's new weights,
              streamed bucket by bucket; the actor holds its weights only (its optimizer state and main
              grads are not needed to export weights: in host memory when actor.offload_when_idle); then
              the protocol goes on to generate
"""

from __future__ import annotations

from dataclasses import dataclass

ACTOR_STATE = ("weights", "main_grads", "optimizer")
"""The actor's persistent device state (what actor.offload_when_idle moves to host memory)."""
ACTOR_TRANSIENT = ("activations",)
"""Held only inside a train step: sized by the planner, 0 in the ledger (recorded between steps)."""
ENGINE_STATE = ("weights", "kv_cache")
"""The rollout engine's memory regions (SGLang's memory tags)."""
PHASES = ("generate", "train", "sync")


@dataclass(frozen=True, kw_only=True)
class Phase:
    """One phase: the components each side holds on the actor's devices."""

    name: str
    actor: tuple[str, ...]
    engine: tuple[str, ...]
    actor_transient: tuple[str, ...] = ()


def phase_model(*, colocate: bool, offload_when_idle: bool) -> dict[str, Phase]:
    """The protocol for a config: rollout.colocate, actor.offload_when_idle. Without colocation the
    engine lives on other devices (nothing of it on the actor's) and the actor never moves."""
    moves = colocate and offload_when_idle

    def engine(*parts: str) -> tuple[str, ...]:
        return parts if colocate else ()

    return {
        "generate": Phase(name="generate", actor=() if moves else ACTOR_STATE, engine=engine(*ENGINE_STATE)),
        "train": Phase(name="train", actor=ACTOR_STATE, engine=(), actor_transient=ACTOR_TRANSIENT),
        "sync": Phase(name="sync", actor=("weights",) if moves else ACTOR_STATE, engine=engine("weights")),
    }
