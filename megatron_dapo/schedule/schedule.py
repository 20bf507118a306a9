"""When the weights move between the actor and the rollout engine, for k = rollout.async_steps, in one place.

k = 0, the synchronous loop (Algorithm 1): step s's batch is collected now, on the weights after step s - 1,
and the weights after step s reach the engine at the step's end (`publish`: a sync, collective).
k = 1: batch s + 1 is generated while step s trains, on the weights the engine still holds; the step waits
for it at the batch boundary (`boundary`), then syncs. Lagged (k >= 2, or async_mode=stream:
`RolloutConfig.lagged`): the engine may be busy with an older batch when a step ends, so the step's weights
are copied to host memory for the producer to hand over when a batch is due them (schedule/pipeline.py).
Before an evaluation a lagged schedule drains and syncs directly (`settle`), so the evaluation scores the
weights after the step; the next batch is due exactly those, so the schedule is unchanged.
Every rank runs the same calls (the syncs are collective); the driver alone holds the pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

from megatron_dapo.actor.actor import Actor, NonFiniteWeightsError
from megatron_dapo.collect.result import StepRollout
from megatron_dapo.collect.streaming import LiveWeights
from megatron_dapo.collect.versions import drop_stale, staleness_scalars
from megatron_dapo.config import RolloutConfig
from megatron_dapo.metrics import PhaseTimer
from megatron_dapo.rollout.base import NonFiniteLogitsError
from megatron_dapo.schedule.pipeline import RolloutPipeline, WeightSnapshot
from megatron_dapo.types import Group

Collect = Callable[[int, int, LiveWeights | None], StepRollout]
"""(step, the engine's policy version, live weights or None) -> the step's rollout (collect/collector.py)."""


class Synced(Protocol):
    def scalars(self) -> dict[str, float]: ...


class WeightMover(Protocol):
    """Moves the actor's weights to the engine (loop/phases.py's Phases): `step` is the step they are from."""

    step: int

    def sync(self, step: int) -> Synced: ...

    def snapshot(self, step: int, due: bool = True) -> tuple[Synced, WeightSnapshot | None]: ...

    def take_snapshot(self, snap: WeightSnapshot) -> None: ...


class Schedule:
    """The run's schedule. `collect` and `threads` on the driver (None elsewhere); `timer` times the waits;
    `actor` and `origin` (the weights the run started from) name the weights of a diverged rollout."""

    def __init__(self, rollout: RolloutConfig, steps: int, weights: WeightMover, collect: Collect | None,
                 timer: PhaseTimer, actor: Actor, origin: str, threads: int | None = None) -> None:
        self.k, self.stream, self.lagged, self.steps = rollout.async_steps, rollout.async_mode == "stream", \
            rollout.lagged, steps
        self.weights, self.collect, self.timer, self.actor, self.origin = weights, collect, timer, actor, origin
        self.start_step = 0
        self.pipeline = RolloutPipeline(threads, self.k, stream=self.stream, produce=self._produce,
                                        apply_weights=weights.take_snapshot) \
            if collect is not None and self.k else None
        """The driver's producer of the next batches (k > 0)."""

    def rollout(self, step: int) -> StepRollout:
        """The driver's batch of step `step`: collected now (k = 0), or the one generated while earlier steps
        trained, the next ones (up to k ahead) started at once."""
        if self.pipeline is None:
            with self.checked(after_step=step - 1):
                return self._collect(step, self.weights.step)
        with self.checked(after_step=self.weights.step):
            rollout = self.pipeline.take(step)
        self.pipeline.fill(step, self.steps)
        return rollout

    def fresh(self, groups: list[Group], step: int) -> tuple[list[Group], dict[str, float]]:
        """Off-policy: the groups at most k versions behind the actor (which has made step - 1 updates), and the
        staleness monitors; synchronous: all of them."""
        if self.pipeline is None:
            return groups, {}
        kept, dropped = drop_stale(groups, step - 1, self.k)
        return kept, staleness_scalars(kept, step - 1, dropped)

    def boundary(self) -> None:
        """k = 1: wait for the next batch (generated from the weights the engine still holds) before those
        weights change. Nothing to do otherwise."""
        if self.pipeline is not None and self.k == 1 and not self.stream:
            with self.checked(after_step=self.weights.step), self.timer("rollout_wait"):
                self.pipeline.wait()

    def publish(self, step: int) -> Synced:
        """The weights after `step` for the engine: synced at once (k <= 1, after the boundary), or copied for
        the producer to hand over when a batch is due them (lagged: batch step + 1 + k is the first; fully
        async, any later one)."""
        if self.lagged:
            due = step + 1 + (0 if self.stream else self.k) <= self.steps
            stats, snapshot = self.weights.snapshot(step, due=due)
        else:
            stats, snapshot = self.weights.sync(step), None
        if self.pipeline is not None:
            self.pipeline.publish(step, snapshot)
        return stats

    def skip(self, step: int) -> None:
        """A step without an update: the boundary as usual; the weights after it are those after the last."""
        self.boundary()
        if self.pipeline is not None:
            self.pipeline.publish(step, None)

    def settle(self, step: int) -> None:
        """Lagged, before an evaluation after a step: the batches in production finish, then the engine takes
        the weights after `step` directly (collective), as in the synchronous loop."""
        if not self.lagged or step <= self.start_step:
            return
        if self.pipeline is not None:
            self.pipeline.drain()
        self.weights.sync(step)
        if self.pipeline is not None:
            self.pipeline.synced(step)

    def scalars(self) -> dict[str, float]:
        """How the engine and the actor overlapped since the last call (off-policy only)."""
        return self.pipeline.step_scalars() if self.pipeline is not None else {}

    def version_scalars(self) -> dict[str, float]:
        """val/policy_version: the weights an evaluation scored (off-policy only)."""
        return {"val/policy_version": float(self.pipeline.version)} if self.pipeline is not None else {}

    @contextmanager
    def checked(self, after_step: int) -> Iterator[None]:
        """An engine's NonFiniteLogitsError, however wrapped (stream, engine group), becomes one line naming the
        weights the rollout ran on: those of step `after_step`'s update, or the ones the run started from."""
        try:
            yield
        except Exception as e:
            cause: BaseException | None = e
            while cause is not None and not isinstance(cause, NonFiniteLogitsError):
                cause = cause.__cause__ or cause.__context__
            if cause is None:
                raise
            if after_step > self.start_step:
                where = f"after step {after_step}: the last update diverged ({self.actor.last_update or 'no update'})"
            else:
                start = f"checkpoint step {after_step}" if after_step else self.origin
                where = f"of step {after_step + 1}: the weights the run started from ({start}) are unusable"
            raise NonFiniteWeightsError(f"non-finite logits in the rollout {where}: {cause}; stopped without "
                                        f"saving these weights (lower actor.optimizer.lr?)") from None

    # --- checkpoints -------------------------------------------------------------------------------------

    def state_dict(self) -> dict | None:
        """The batches generated and not yet trained on (finished first: call at the batch boundary)."""
        return self.pipeline.state_dict() if self.pipeline is not None else None

    def load_state_dict(self, state: dict | None, step: int) -> None:
        """Resumed at checkpoint step `step`: its pending batches were generated by that step's weights."""
        self.start_step = step
        if self.pipeline is not None:
            self.pipeline.load_state_dict(state, version=step)

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()

    def _produce(self, step: int) -> StepRollout:
        """The producer thread's batch `step`, on the engine's weights as the pipeline tracks them."""
        assert self.pipeline is not None
        return self._collect(step, self.pipeline.version)

    def _collect(self, step: int, version: int) -> StepRollout:
        assert self.collect is not None, "only the driver collects"
        return self.collect(step, version, self.pipeline if self.stream else None)
