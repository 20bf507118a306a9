"""Streaming over several engines (an `EngineGroup`): one stream per engine behind one `RolloutStream`.

A submitted group goes to the live engine with the fewest pending groups per unit of weight (its
share: e.g. a nested group's size), so a server that finishes groups faster receives more. One thread
per engine waits on that engine's stream and forwards its finished groups, so `next()` returns
whichever engine finishes first. A group's samples depend on its request only, not on the engine it
lands on (per-group seeds). An engine's failure is raised by `next()` as `EngineGroupFailure`, naming
the engine, once the groups that finished before it are delivered; that engine receives no more
groups, and `abort()` still cancels everywhere (and logs a failure that next() never raised). A `next()`
waiting in another thread when `abort()` runs raises GenerationAborted: so a group nested in another
(rank 0's server beside an attached node group) lets the outer group's abort finish.

With a `recovery` (restarts.py), an engine that is lost (dead, or hung past its health check) is not a
failure: it is stopped for good, the groups it held go to the engines that hold the current weights, as
they were requested (prompt, seed, carried-in samples: nothing is trained twice or dropped), and it is
started again from its own thread while the others keep generating. Where the run can give it the current
weights now (Restarts.refresh) it takes them and streams again; else it takes no group until a weight
update has made it current. With no other current engine its groups wait for it. Past the run's restart
budget, or with nobody to take its groups, `next()` raises EngineLostError (one line).
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Sequence
from contextlib import suppress

from megatron_dapo.rollout.base import (
    AbortReport,
    EngineStateError,
    GenerationAborted,
    GroupRequest,
    GroupResult,
    RolloutStream,
)
from megatron_dapo.rollout.restarts import EngineLostError, EngineRecovery

log = logging.getLogger(__name__)


class EngineGroupFailure(RuntimeError):
    """An engine of a group failed while streaming; the message names it."""


class GroupStream(RolloutStream):
    """`streams` (one per engine, labelled `names`, sharing by `weights`) as one stream."""

    def __init__(self, streams: Sequence[RolloutStream], names: Sequence[str],
                 weights: Sequence[int], recovery: EngineRecovery | None = None) -> None:
        self._streams, self._names, self._weights = list(streams), list(names), list(weights)
        self._recovery = recovery
        self._requests: dict[int, GroupRequest] = {}  # pending groups' requests (resubmitted if their engine is lost)
        self._cond = threading.Condition()
        self._owner: dict[int, int] = {}  # pending group -> its engine
        self._owed = [0] * len(self._streams)  # groups engine k still has to deliver
        self._busy = [False] * len(self._streams)  # engine k's thread is inside its stream's next()
        self._failed: set[int] = set()
        self._errors: list[tuple[int, BaseException]] = []  # engine failures next() has yet to raise
        self._ready: dict[int, GroupResult] = {}  # finished groups, in arrival order
        self._aborting = self._closed = False
        self._epoch = 0  # abort() counts up: a next() waiting across an abort raises GenerationAborted
        self._recoveries: list[threading.Thread] = []  # lost engines' recoveries (close() waits for them)
        self._threads = [threading.Thread(target=self._pump, args=(k,), daemon=True, name=f"group-stream-{k}")
                         for k in range(len(self._streams))]
        for t in self._threads:
            t.start()

    @property
    def pending(self) -> int:
        return len(self._owner)

    def submit(self, requests: Sequence[GroupRequest]) -> None:
        keys = [r.key for r in requests]
        with self._cond:
            if len(set(keys)) != len(keys) or any(key in self._owner for key in keys):
                raise ValueError(f"group keys {keys} repeat each other or a pending group")
            load = list(self._owed)
            placed: dict[int, list[GroupRequest]] = defaultdict(list)
            for r in requests:
                k = self._least_loaded(load)
                placed[k].append(r)
                load[k] += 1
            for k, reqs in placed.items():  # a refused submit leaves the earlier engines' groups pending
                self._streams[k].submit(reqs)
                self._owner.update((r.key, k) for r in reqs)
                self._requests.update((r.key, r) for r in reqs)
                self._owed[k] += len(reqs)
            self._cond.notify_all()

    def next(self) -> GroupResult:
        with self._cond:
            if not self._owner:
                raise EngineStateError("engine group stream: no group is pending")
            epoch = self._epoch  # an abort under way has named the pending groups: none is delivered now
            while self._aborting or (not self._ready and not self._errors and self._epoch == epoch):
                self._cond.wait()
            if self._epoch != epoch:  # e.g. this group nested in another whose abort() reached us
                raise GenerationAborted("engine group stream: aborted")
            if self._ready:  # groups finished before a failure are delivered first
                key = next(iter(self._ready))
                del self._owner[key]
                self._requests.pop(key, None)
                return self._ready.pop(key)
            k, error = self._errors.pop(0)
        if isinstance(error, EngineLostError):
            raise error
        raise EngineGroupFailure(f"streaming failed on rollout engine {self._names[k]}: {error}") from error

    def abort(self) -> AbortReport:
        with self._cond:
            self._aborting = True
            keys = sorted(self._owner)
        tokens, partial = 0, {}
        for stream in self._streams:
            with suppress(Exception):  # a failed engine's stream may not answer: its groups are lost
                report = stream.abort()
                tokens += report.tokens
                partial.update(report.partial)
        with self._cond:
            while any(self._busy):
                self._cond.wait(timeout=1.0)
            tokens += sum(item.tokens for item in self._ready.values())
            partial.update({key: list(item.samples) for key, item in self._ready.items()})
            for k, error in self._errors:  # not raised: the step ended before it needed that engine
                log.warning("rollout engine %s failed while streaming: %s", self._names[k], error)
            self._ready, self._errors, self._owner, self._requests = {}, [], {}, {}
            self._owed = [0] * len(self._streams)
            self._aborting = False
            self._epoch += 1
            self._cond.notify_all()
        return AbortReport(keys=keys, tokens=tokens, partial=partial)

    def close(self) -> None:
        try:
            super().close()
            for stream in self._streams:
                with suppress(Exception):
                    stream.close()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            for thread in self._recoveries:  # a restart under way ends with the rollout: no server starts while the
                thread.join()  # actor trains, and no refresh's collectives meet the training's

    def _least_loaded(self, load: list[int]) -> int:
        live = [k for k in range(len(self._streams)) if self.live(k)]
        if not live:
            raise EngineGroupFailure(f"every rollout engine failed: {', '.join(self._names)}")
        return min(live, key=lambda k: ((load[k] + 1) / self._weights[k], k))

    def _pump(self, k: int) -> None:
        """Engine k's thread: wait for its groups, forward each as it finishes."""
        stream = self._streams[k]
        while True:
            with self._cond:
                while not self._closed and (self._owed[k] == 0 or k in self._failed or self._aborting):
                    self._cond.wait()
                if self._closed:
                    return
                self._busy[k] = True
            try:
                item: GroupResult | BaseException = stream.next()
            except BaseException as e:  # noqa: BLE001 - raised by next(), naming the engine
                item = e
            with self._cond:
                self._busy[k] = False
                if isinstance(item, GroupResult):
                    self._owed[k] -= 1
                    self._ready[item.key] = item
                elif not self._aborting and self._recovery is not None and (why := self._recovery.lost(k)):
                    self._failed.add(k)  # takes no group until restarted and current
                    self._recoveries.append(threading.Thread(target=self._recover, args=(k, why), daemon=True,
                                                             name=f"group-stream-recover-{k}"))
                    self._recoveries[-1].start()
                    return
                elif self._aborting:  # cut short, or it found its groups already cancelled: no failure
                    if not isinstance(item, (GenerationAborted, EngineStateError)):
                        log.warning("rollout engine %s failed during an abort: %s", self._names[k], item)
                else:
                    self._failed.add(k)
                    self._errors.append((k, item))
                self._cond.notify_all()

    def _recover(self, k: int, why: str) -> None:
        """Engine k is lost: stop it for good, hand its groups to the current engines (held for k where there are
        none), start it again, and stream on it again once it holds the current weights."""
        try:
            self._recovery.take(k, why)
            with suppress(Exception):
                self._streams[k].close()  # its calls end with the server
            with self._cond:
                moved = [self._requests[key] for key, owner in self._owner.items()
                         if owner == k and key not in self._ready]
                self._owed[k] = 0
                held, epoch = self._place(moved), self._epoch
            self._recovery.restarts.resubmitted(len(moved))
            self._recovery.restart(k)
            with self._cond:
                if self._closed:  # the rollout is over: the next one gives it the weights first
                    return
                idle = not any(self.live(j) for j in range(len(self._streams)) if j != k)
            if not self._recovery.make_current(k, idle):
                if held:
                    raise EngineLostError(f"rollout engine {self._names[k]} was lost and no other engine holds the "
                                          "current weights to take its groups, nor can the run give them to it now; "
                                          "stopped without saving")
                return  # stale: it takes no group until the next weight update
            self._reopen(k, held, epoch)
        except BaseException as e:  # noqa: BLE001 - raised by next()
            with self._cond:
                self._errors.append((k, e if isinstance(e, EngineLostError) else EngineLostError(
                    f"rollout engine {self._names[k]}: {why}; it could not be recovered: {e}")))
                self._cond.notify_all()

    def _reopen(self, k: int, held: list[GroupRequest], epoch: int) -> None:
        """Restarted engine k holds the current weights: a new stream and thread for it, and the groups held for it
        (unless an abort dropped them meanwhile)."""
        stream = self._recovery.engines[k].stream()
        with self._cond:
            if self._closed:
                stream.close()
                return
            self._streams[k] = stream
            self._failed.discard(k)
            self._threads[k] = threading.Thread(target=self._pump, args=(k,), daemon=True, name=f"group-stream-{k}")
            self._threads[k].start()
            if self._epoch == epoch:
                self._place(held)

    def live(self, k: int) -> bool:
        """Whether engine k takes groups: not failed or lost, and current."""
        return k not in self._failed and (self._recovery is None or self._recovery.fresh(k))

    def _place(self, moved: list[GroupRequest]) -> list[GroupRequest]:
        """Under the lock: `moved` (a lost engine's groups) to the least loaded current engines; those no current
        engine can take are returned."""
        if not any(self.live(k) for k in range(len(self._streams))):
            return moved
        load = list(self._owed)
        for r in moved:
            j = self._least_loaded(load)
            self._streams[j].submit([r])
            self._owner[r.key] = j
            self._owed[j] += 1
            load[j] += 1
        self._cond.notify_all()
        return []
