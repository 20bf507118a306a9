"""Peak-memory and time measurement for the benchmark tools (tools/bench_loss.py, tools/bench_actor.py),
and forward-pass counting for tools/bench_dynamic.py (`ForwardCounter`).

Each case runs in a fresh subprocess (`run_case`), so one case's allocations never inflate another's
peak. Inside it, `PeakMemory` measures the extra memory a block needs over what was alive before it:
on CUDA torch.cuda.max_memory_allocated; on CPU the peak resident set (VmHWM, reset through
/proc/self/clear_refs) minus the resident set before, with glibc told (`MALLOC_ENV`) to mmap every
allocation >= 64 KiB and to trim at once, so freed tensors leave the resident set.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
REPO = Path(__file__).resolve().parents[1]


def available_bytes() -> int:
    """MemAvailable of this machine (a huge number where /proc/meminfo does not say)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 62


def resident(field: str = "VmRSS") -> int:
    """This process's VmRSS / VmHWM in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def load_text() -> str:
    return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus"


def limit_address_space(nbytes: int) -> None:
    """Fail with a MemoryError instead of meeting the OOM killer (the machine may be shared)."""
    if nbytes:
        resource.setrlimit(resource.RLIMIT_AS, (nbytes, nbytes))


class PeakMemory:
    """`with PeakMemory(device) as m: ...` then `m.peak`: bytes above what was allocated at entry."""

    def __init__(self, device: str | torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.peak = 0

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        else:
            self._base = resident("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current resident set
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self._base
        else:
            self.peak = resident("VmHWM") - self._base


def run_case(args: list[str], *, timeout: float, label: str, env: dict[str, str] | None = None) -> dict | None:
    """Run `python args...` in a fresh process with the allocator settings of `MALLOC_ENV` and this repo
    first on the path; returns the JSON object its stdout ends with (None, reported, if it failed)."""
    full_env = {**os.environ, **MALLOC_ENV, **(env or {})}
    full_env["PYTHONPATH"] = f"{REPO}{os.pathsep}{full_env.get('PYTHONPATH', '')}"
    proc = subprocess.run([sys.executable, *args], check=False, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        print(f"# {label} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


class ForwardCounter:
    """Model forward passes and prefill positions: the embedded engine's decoder calls (a prefill's
    positions include its padding), or the batches an SGLang server logged (its #new-token: radix-cache
    hits excluded)."""

    def __init__(self, engine: Any) -> None:
        self.log = getattr(engine, "log_path", None)
        self.calls = self.prefilled = 0

    def counts(self) -> tuple[int, int]:
        """(forward passes, prefill positions) so far; an SGLang log is read once for both."""
        if self.log is None:
            return self.calls, self.prefilled
        text = Path(self.log).read_text(errors="replace")
        prefilled = sum(int(n) for n in re.findall(r"Prefill batch[^\n]*?#new-token: (\d+)", text))
        return text.count("Decode batch") + text.count("Prefill batch"), prefilled

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        if self.log is not None:
            yield
            return
        from megatron_dapo.rollout.embedded.decoders import HFDecoder, LlamaDecoder

        originals = {cls: cls._forward for cls in (HFDecoder, LlamaDecoder)}

        def wrap(forward):
            def counted(decoder, ids, *a, **k):
                self.calls += 1
                if ids.shape[1] > 1:
                    self.prefilled += ids.numel()
                return forward(decoder, ids, *a, **k)
            return counted

        for cls, forward in originals.items():
            setattr(cls, "_forward", wrap(forward))
        try:
            yield
        finally:
            for cls, forward in originals.items():
                setattr(cls, "_forward", forward)
