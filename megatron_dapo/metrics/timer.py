"""Wall time per phase of a step, and the progress bar."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any


class PhaseTimer:
    """Wall time per named phase of a step (`with timer("rollout"): ...`); `take()` returns and resets."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] += time.perf_counter() - t0

    def take(self) -> dict[str, float]:
        out = dict(self._seconds)
        self._seconds.clear()
        return out


def progress(steps: range, enabled: bool) -> Any:
    """A tqdm bar over `steps` on the driver rank; the plain range elsewhere."""
    if not enabled:
        return steps
    from tqdm import tqdm

    return tqdm(steps, desc="dapo", unit="step", initial=0, total=len(steps), dynamic_ncols=True)
