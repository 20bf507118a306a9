"""A transformers model's parameters under the names its checkpoint (and SGLang, and our weight sync) uses.

transformers >= 5 keeps the routed experts of a Qwen2-MoE / Qwen3-MoE layer fused in memory
(`mlp.experts.gate_up_proj` [E, 2I, H] = [gate; up] per expert, `mlp.experts.down_proj` [E, H, I]),
while a checkpoint names one tensor per expert (`mlp.experts.<e>.gate_proj.weight`, `up_proj`,
`down_proj`). The views below alias the fused parameters, so copying into a view updates the model.
"""

from __future__ import annotations

import re

from torch import Tensor

_FUSED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def checkpoint_views(params: dict[str, Tensor]) -> dict[str, Tensor]:
    """Every parameter by checkpoint name; a fused expert tensor becomes one view per expert and projection."""
    views: dict[str, Tensor] = {}
    for name, param in params.items():
        m = _FUSED.match(name)
        if m is None or param.dim() != 3:
            views[name] = param
            continue
        prefix = m.group("prefix")
        for e in range(param.shape[0]):
            if m.group("kind") == "down_proj":
                views[f"{prefix}.{e}.down_proj.weight"] = param[e]
            else:
                gate, up = param[e].chunk(2, dim=0)
                views[f"{prefix}.{e}.gate_proj.weight"], views[f"{prefix}.{e}.up_proj.weight"] = gate, up
    return views
