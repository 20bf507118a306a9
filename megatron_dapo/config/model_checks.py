"""Layout checks against the model's own config.json (when model.hf_dir holds one), read as plain JSON
so that `validate()` stays light: a TP size that does not divide the attention / KV heads or the MLP
width, or a PP size that does not divide the layers, is refused before any process group starts."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from megatron_dapo.config.schema import Config


def read_model_config(hf_dir: str | None) -> dict[str, Any] | None:
    """config.json of `hf_dir` as a dict; None when there is no such file (or it is not a JSON object)."""
    if not hf_dir:
        return None
    path = Path(hf_dir) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_constraints(model: dict[str, Any]) -> dict[str, int]:
    """The sizes a tensor-parallel degree must divide: attention heads, KV heads, MLP width."""
    heads = model.get("num_attention_heads")
    out = {"num_attention_heads": heads,
           "num_key_value_heads": model.get("num_key_value_heads") or heads,
           "intermediate_size": model.get("intermediate_size")}
    return {k: v for k, v in out.items() if isinstance(v, int) and v > 0}


def valid_tp_sizes(model: dict[str, Any]) -> list[int]:
    sizes = list(tp_constraints(model).values())
    return _divisors(math.gcd(*sizes)) if sizes else []


def model_problems(cfg: Config) -> list[str]:
    """Problems of cfg.parallel (and SGLang's TP) against model.hf_dir/config.json; [] without one."""
    model = read_model_config(cfg.model.hf_dir)
    if model is None:
        return []
    p: list[str] = []
    where = f"model.hf_dir={cfg.model.hf_dir}"
    limits = tp_constraints(model)
    tps = [("parallel.tensor_parallel", cfg.parallel.tensor_parallel)]
    if cfg.rollout.engine == "sglang":
        tps.append(("rollout.sglang.tensor_parallel", cfg.rollout.sglang.tensor_parallel))
    for key, tp in tps:
        bad = [f"{name}={n}" for name, n in limits.items() if tp > 0 and n % tp]
        if bad:
            valid = ", ".join(map(str, valid_tp_sizes(model)))
            p.append(f"{key}={tp} does not divide {', '.join(bad)} of {where}; valid TP sizes: {valid}")
    layers, pp = model.get("num_hidden_layers"), cfg.parallel.pipeline_parallel
    if isinstance(layers, int) and layers > 0 and pp > 0 and layers % pp:
        valid = ", ".join(map(str, _divisors(layers)))
        p.append(f"parallel.pipeline_parallel={pp} does not divide num_hidden_layers={layers} of {where}; "
                 f"valid PP sizes: {valid}")
    return p
