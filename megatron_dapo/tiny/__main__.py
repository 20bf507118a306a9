"""Build the tiny base policy of the embedded default (see `megatron_dapo.tiny.base`).

    python -m megatron_dapo.tiny --out checkpoints/tiny_base            # ~2.5 min on a 2-core CPU
    python -m megatron_dapo.tiny --out /tmp/tb --steps 20 --force       # seconds; a useless model
    python -m megatron_dapo.tiny --recipe steps                          # the DAPO study's base
    python -m megatron_dapo.tiny --recipe moe                            # examples/configs/tiny_moe_cpu.yaml's
    python -m megatron_dapo.tiny --recipe tool                           # examples/configs/tiny_tool_cpu.yaml's

`tools/make_tiny_base.py` is the same command. Exit 2 when --out is taken or a limit is not positive.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace

from megatron_dapo.tiny import moe_base, steps_base, tool_base
from megatron_dapo.tiny.base import (
    DEFAULT_OUT,
    OutputExistsError,
    Settings,
    arithmetic_recipe,
    build_tiny_base,
)

EXIT_REFUSED = 2
RECIPES = {"tiny": (arithmetic_recipe, DEFAULT_OUT), "steps": (steps_base.steps_recipe, steps_base.DEFAULT_OUT),
           "moe": (moe_base.moe_recipe, moe_base.DEFAULT_OUT), "tool": (tool_base.tool_recipe, tool_base.DEFAULT_OUT)}
"""--recipe: (the recipe, its default folder)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megatron_dapo.tiny",
        description="Build the tiny base policy (a character-level tokenizer and a small Qwen2 warm-started "
                    "on the built-in arithmetic task) as a Hugging Face folder.",
    )
    p.add_argument("--recipe", choices=tuple(RECIPES), default="tiny",
                   help="tiny: the embedded default's base; steps: the DAPO study's (megatron_dapo.tiny.steps_base); "
                        "moe: a Qwen3-MoE on the tiny task (megatron_dapo.tiny.moe_base); tool: calls the Python tool on "
                        "3-digit products some of the time (megatron_dapo.tiny.tool_base)")
    p.add_argument("--out", help="output folder (default " + ", ".join(f"{out} for {name}" for name, (_, out)
                                                                       in RECIPES.items()) + ")")
    p.add_argument("--seconds", type=float, help="wall-time limit of training (default: the recipe's)")
    p.add_argument("--steps", type=int, help="step limit and length of the lr schedule (default: the recipe's)")
    p.add_argument("--seed", type=int, default=Settings.seed)
    p.add_argument("--threads", type=int, default=Settings.threads,
                   help="torch threads while building (default 1; 0 leaves torch's default)")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (args.steps is not None and args.steps < 1) or (args.seconds is not None and args.seconds <= 0):
        print("error: --steps and --seconds must be positive", file=sys.stderr)
        return EXIT_REFUSED
    make_recipe, default_out = RECIPES[args.recipe]
    recipe, out = make_recipe(), args.out or default_out
    settings = replace(recipe.settings, seed=args.seed, threads=args.threads or None,
                       seconds=recipe.settings.seconds if args.seconds is None else args.seconds,
                       max_steps=recipe.settings.max_steps if args.steps is None else args.steps)
    try:
        build_tiny_base(out, settings, force=args.force, recipe=recipe)
    except OutputExistsError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main())
