"""The tiny MoE base: the tiny base's arithmetic warm-start on a small Qwen3-MoE (8 routed experts, top 2, in
each of 4 layers), so that MoE training (expert parallelism, the fp32 router, routing replay) runs end to end on
a CPU: examples/configs/tiny_moe_cpu.yaml.

    python -m megatron_dapo.tiny --recipe moe              # checkpoints/tiny_moe_base

The build machinery, files and fingerprinting are the tiny base's (`megatron_dapo.tiny.base`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from megatron_dapo.tiny.base import Recipe, arithmetic_recipe, ensure_base

DEFAULT_OUT = "checkpoints/tiny_moe_base"
VERSION = 1


def moe_recipe() -> Recipe:
    """The tiny base's task and data; 2 of 8 experts a token, each a quarter of the dense MLP's width."""
    dense = arithmetic_recipe()
    settings = replace(dense.settings, experts=8, experts_per_token=2, intermediate_size=64)
    return replace(dense, name="tiny MoE base", version=VERSION, settings=settings,
                   data={**dense.data, "model": "qwen3_moe"})


def ensure_moe_base(out: str | Path = DEFAULT_OUT, seconds: float | None = None, *, seed: int = 0) -> Path:
    """`out`, after building the tiny MoE base there unless it holds one of this recipe's fingerprint."""
    return ensure_base(moe_recipe(), out, seconds, seed=seed)
