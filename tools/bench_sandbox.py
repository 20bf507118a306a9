"""What a sandbox call costs: seconds per call (each call is a fresh sandbox and interpreter: always cold) and
calls/s through SandboxPool, against this interpreter run unsandboxed (`python -I`, same packages) as the
reference.

    python tools/bench_sandbox.py [--calls 20] [--workers 2] [--json]

first_call_s includes the once-per-process start-up check (one extra sandbox). Snippets: `print(1)` and
`import numpy` (with the venv's site-packages, the default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from megatron_dapo.sandbox import SandboxConfig, SandboxPool, run_code


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    cfg = SandboxConfig(workers=args.workers)
    out: dict[str, float] = {"first_call_s": timed(lambda: run_code("print(1)", cfg))}
    for name, code in (("print", "print(1)"), ("numpy", "import numpy")):
        sandboxed = [timed(lambda: run_code(code, cfg)) for _ in range(args.calls)]
        plain = [timed(lambda: subprocess.run([sys.executable, "-I", "-c", code], check=True, capture_output=True))
                 for _ in range(args.calls)]
        out[f"{name}_call_s"] = statistics.median(sandboxed)
        out[f"{name}_unsandboxed_s"] = statistics.median(plain)
    with SandboxPool(cfg) as pool:
        t0 = time.perf_counter()
        pool.map(["print(1)"] * args.calls * 2)
        out[f"pool{args.workers}_calls_per_s"] = args.calls * 2 / (time.perf_counter() - t0)
    out["cpus"] = len(os.sched_getaffinity(0))
    if args.json:
        print(json.dumps({k: round(v, 4) for k, v in out.items()}))
    else:
        for k, v in out.items():
            print(f"{k:28s} {v:.4f}")
        print(f"sandbox / plain (print): x{out['print_call_s'] / out['print_unsandboxed_s']:.2f}")


if __name__ == "__main__":
    main()
