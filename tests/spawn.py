"""Run a function on N local gloo ranks with torch.multiprocessing, never hanging a test."""

import time

import pytest
import torch.multiprocessing as mp

from megatron_dapo.parallel import free_port


def run_ranks(fn, *args, nprocs: int = 2, timeout_s: float = 120.0) -> None:
    """Spawn fn(rank, nprocs, port, *args) on `nprocs` ranks; a worker's exception re-raises here."""
    ctx = mp.spawn(fn, args=(nprocs, free_port(), *args), nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
                p.join(timeout=30)  # reaped: nothing of the test outlives it
            pytest.fail(f"{nprocs}-process gloo test timed out after {timeout_s:.0f} s")
