"""Build the tiny base policy of the embedded default (see `megatron_dapo.tiny.base`).

    python -m megatron_dapo.tiny --out checkpoints/tiny_base            # ~2.5 min on a 2-core CPU
    python -m megatron_dapo.tiny --out /tmp/tb --steps 20 --force       # seconds; a useless model

`tools/make_tiny_base.py` is the same command. Exit 2 when --out is taken or a limit is not positive.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from megatron_dapo.tiny.base import DEFAULT_OUT, OutputExistsError, Settings, build_tiny_base

EXIT_REFUSED = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megatron_dapo.tiny",
        description="Build the tiny base policy (a character-level tokenizer and a small Qwen2 warm-started "
                    "on the built-in arithmetic task) as a Hugging Face folder.",
    )
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--seconds", type=float, default=Settings.seconds, help="wall-time limit of training")
    p.add_argument("--steps", type=int, default=Settings.max_steps,
                   help="step limit (and length of the lr schedule)")
    p.add_argument("--seed", type=int, default=Settings.seed)
    p.add_argument("--threads", type=int, default=Settings.threads,
                   help="torch threads while building (default 1; 0 leaves torch's default)")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.steps < 1 or args.seconds <= 0:
        print("error: --steps and --seconds must be positive", file=sys.stderr)
        return EXIT_REFUSED
    settings = Settings(
        seconds=args.seconds, max_steps=args.steps, seed=args.seed, threads=args.threads or None
    )
    try:
        build_tiny_base(args.out, settings, force=args.force)
    except OutputExistsError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main())
