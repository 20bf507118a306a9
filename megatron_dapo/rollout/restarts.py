"""A run's budget of rollout-engine restarts (rollout.sglang.max_restarts) and what they cost (monitors).

An engine that dies or hangs mid-generation is restarted in place by whoever drives it (an engine group's
stream or rounds, the process engine); each restart first takes one from this budget. Past it, the run
stops with `EngineLostError`: one line naming the engine, why it was lost (its exit status) and the last
lines of its log.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


class EngineLostError(RuntimeError):
    """A rollout engine died or hung and could not be restarted (the budget is spent, or it did not start
    again); the run stops without saving anything new."""


@dataclass
class Restarts:
    """`max_restarts` restarts for the whole run; the counters are the run's totals."""

    max_restarts: int
    engine_restarts: int = 0
    resubmitted_groups: int = 0
    remote: bool = True
    """Another node's servers can be restarted (by their own ranks, at the driver's request): the other ranks
    wait for the driver while it generates (rollout.async_steps = 0)."""
    refresh: Callable[[Any, bool], bool] | None = field(default=None, repr=False)
    """refresh(engines, idle): the restarted `engines` take the current weights now, mid-rollout; False where they
    cannot (`idle`: no engine of the run generates meanwhile). The loop's (Phases.refresh); None: they wait for the
    next weight update."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def take(self, name: str, why: str, log_tail: str = "") -> None:
        """Account for restarting engine `name` (lost because `why`); EngineLostError past the budget."""
        with self._lock:
            if self.engine_restarts >= self.max_restarts:
                tail = " | ".join(line.strip() for line in log_tail.splitlines()[-5:] if line.strip())
                raise EngineLostError(
                    f"rollout engine {name}: {why}, after {self.engine_restarts} restart(s) this run "
                    f"(rollout.sglang.max_restarts={self.max_restarts}); stopped without saving"
                    + (f"; last lines of its log: {tail}" if tail else ""))
            self.engine_restarts += 1
        log.warning("rollout engine %s: %s; restarting it (restart %d of at most %d this run)", name, why,
                    self.engine_restarts, self.max_restarts)

    def resubmitted(self, count: int) -> None:
        with self._lock:
            self.resubmitted_groups += count

    def state_dict(self) -> dict[str, int]:
        """The run's counts: max_restarts is a budget for the whole run, resumes included."""
        return {"engine_restarts": self.engine_restarts, "resubmitted_groups": self.resubmitted_groups}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.engine_restarts = int(state.get("engine_restarts", 0))
        self.resubmitted_groups = int(state.get("resubmitted_groups", 0))

    def scalars(self) -> dict[str, float]:
        return {"rollout/engine_restarts": float(self.engine_restarts),
                "rollout/resubmitted_groups": float(self.resubmitted_groups)}


def stale_engines(engine: Any) -> Any:
    """The engines of `engine` (an engine group, maybe wrapped) restarted since they last took weights, as one engine
    (an EngineGroup); None when there are none or `engine` restarts nothing."""
    part = getattr(engine, "stale_part", None)
    return part() if part is not None else None


@dataclass
class EngineRecovery:
    """How a group recovers its engine k: a restartable engine (`lost`, `kill`, `restart`; SGLang servers) that
    is lost is killed, its groups go to the engines that hold the current weights (`fresh`), and it starts again
    (stale until the next weight update)."""

    engines: list
    names: list[str]
    restarts: Restarts

    def lost(self, k: int) -> str | None:
        engine = self.engines[k]
        if not all(hasattr(engine, a) for a in ("lost", "kill", "restart")):
            return None
        return engine.lost()

    def fresh(self, k: int) -> bool:
        return not getattr(self.engines[k], "stale_weights", False)

    def take(self, k: int, why: str) -> None:
        """One restart from the budget (EngineLostError past it), then the engine is stopped for good."""
        tail = getattr(self.engines[k], "log_tail", lambda: "")()
        self.restarts.take(self.names[k], why, tail)
        self.engines[k].kill()

    def refresh(self, engine: Any, idle: bool) -> bool:
        """`engine` (restarted engines) takes the current weights now, if the run can give them (Restarts.refresh)."""
        return self.restarts.refresh is not None and self.restarts.refresh(engine, idle)

    def make_current(self, k: int, idle: bool) -> bool:
        """Restarted engine k takes the current weights now (refresh); whether it holds them after."""
        return self.refresh(self.engines[k], idle) and self.fresh(k)

    def restart(self, k: int) -> None:
        """Blocking; EngineLostError when it does not start again."""
        try:
            self.engines[k].restart()
        except Exception as e:  # noqa: BLE001 - becomes the run's one line
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise EngineLostError(f"rollout engine {self.names[k]} did not start again after a restart: {first}; "
                                  "stopped without saving") from e
