"""train.deterministic: what it asks of each library, set once at start-up before any CUDA, NCCL or TE call.

- torch: `use_deterministic_algorithms(True)` (an op without a deterministic kernel raises), cuBLAS with a fixed
  workspace (CUBLAS_WORKSPACE_CONFIG, which torch demands for it).
- Megatron / Transformer Engine: `TransformerConfig.deterministic_mode` (actor/model.py follows torch's switch;
  Megatron then also refuses TE attention unless NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, TE's deterministic backward).
- NCCL: the Ring algorithm (its reduction order is fixed by the topology).
- SGLang: `--enable-deterministic-inference` (batch-invariant kernels, pytorch sampling, a deterministic attention
  backend); without it SGLang ignores the per-request sampling seed. The CPU engine (torch_native) refuses it.
The values follow Megatron's deterministic-training guide (docs.nvidia.com/megatron/deterministic-training).
Cost: a slower actor backward (TE's deterministic attention backward, Megatron's embedding backward, Ring only) and
slower rollouts (SGLang's batch-invariant kernels and pytorch sampling); measure both on the GPUs in question
(tools/bench_actor.py, tools/bench_rollout.py). Off, a resumed GPU run is a valid continuation (same weights,
optimizer state, data position and seeds), not the same run.
"""

from __future__ import annotations

import os

import torch

DETERMINISTIC_ENV = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring"}
"""Filled where unset; a value the user set is kept, except one that allows TE's nondeterministic algorithms."""


def deterministic_env(environ: dict[str, str]) -> dict[str, str]:
    """The variables train.deterministic adds to `environ` (a ValueError for a setting that contradicts it)."""
    nvte = environ.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO")
    if nvte not in (None, "", "0"):
        raise ValueError(f"train.deterministic=true but NVTE_ALLOW_NONDETERMINISTIC_ALGO={nvte}: unset it or set 0")
    return {k: v for k, v in DETERMINISTIC_ENV.items() if not environ.get(k)}


def enable() -> None:
    """Everything train.deterministic asks of this process (the SGLang servers get their flag from
    loop/engines.py: rollout/sglang/server.py DETERMINISTIC_FLAG)."""
    os.environ.update(deterministic_env(dict(os.environ)))
    torch.use_deterministic_algorithms(True)



def line(deterministic: bool, engine: str) -> str:
    """The start-up summary's account of train.deterministic."""
    if not deterministic:
        return ("off (train.deterministic=false): on a GPU a resumed run is a valid continuation of this one, not "
                "the same run (SGLang ignores the sampling seed, TE's attention backward is not deterministic)")
    sglang = "" if engine != "sglang" else ", SGLang " + (
        "--enable-deterministic-inference" if torch.cuda.is_available() else "(its CPU engine cannot: samples unseeded)")
    return ("on: torch deterministic algorithms, Megatron deterministic_mode, "
            + ", ".join(f"{k}={os.environ.get(k, '')}" for k in DETERMINISTIC_ENV) + sglang)
