"""`python -m megatron_dapo.sandbox FILE [--timeout S]`: run FILE exactly as a rollout's tool call does and
print one JSON line {"status", "stdout", "stderr", "seconds"}. `-` reads the code from stdin."""

from __future__ import annotations

import argparse
import json
import sys

from megatron_dapo.sandbox.http import HttpSandbox
from megatron_dapo.sandbox.local import run_code
from megatron_dapo.sandbox.types import SandboxConfig, SandboxUnavailable


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_dapo.sandbox", description=__doc__)
    ap.add_argument("file", help="a Python file, or - for stdin")
    ap.add_argument("--timeout", type=float, default=SandboxConfig.timeout_s, help="wall-clock seconds")
    ap.add_argument("--memory-mb", type=int, default=SandboxConfig.memory_mb)
    ap.add_argument("--url", default="", help="a SandboxFusion-compatible service instead of the local sandbox")
    args = ap.parse_args(argv)
    try:
        code = sys.stdin.read() if args.file == "-" else open(args.file, encoding="utf-8").read()
        cfg = SandboxConfig(timeout_s=args.timeout, memory_mb=args.memory_mb, url=args.url)
        result = HttpSandbox(cfg).run(code) if cfg.url else run_code(code, cfg)
    except (OSError, ValueError, SandboxUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
