"""The command line that starts an SGLang server, and the python that runs it."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_dapo.rollout.sglang.wire import ROUTES_FLAG

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_VENV_PYTHON = REPO_ROOT / ".venv-sglang" / "bin" / "python"
CPU_DEFAULT_MAX_TOTAL_TOKENS = 16384
"""KV-cache size on CPU when none is given (SGLang's own default there is ~15 GB of RAM)."""
DETERMINISTIC_FLAG = "--enable-deterministic-inference"
"""Batch-invariant kernels, pytorch sampling, a deterministic attention backend: only then does SGLang honour the
per-request sampling seed (sglang 0.5.23 arg_groups/overrides.py refuses torch_native, the CPU engine's)."""


def default_python() -> str:
    """The python that runs the server: $MEGATRON_DAPO_SGLANG_PYTHON, else the venv of
    tools/sglang_venv.sh ($MEGATRON_DAPO_SGLANG_VENV or the repo's .venv-sglang) if built, else ours."""
    if os.environ.get("MEGATRON_DAPO_SGLANG_PYTHON"):
        return os.environ["MEGATRON_DAPO_SGLANG_PYTHON"]
    venv = os.environ.get("MEGATRON_DAPO_SGLANG_VENV")
    candidate = Path(venv) / "bin" / "python" if venv else DEFAULT_VENV_PYTHON
    return str(candidate) if candidate.exists() else sys.executable


def launch_command(server: Any, dtype: str, colocate: bool, max_total_tokens: int | None,
                   extra_args: Sequence[str]) -> list[str]:
    """`python -m sglang.launch_server ...` for an SGLangServer (its python, model, address, config, device)."""
    user = shlex.split(server.cfg.extra_args) + list(extra_args)
    cmd = [
        server.python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        server.model_path,
        "--host",
        server.host,
        "--port",
        str(server.port),
        "--skip-tokenizer-init",
        "--dtype",
        dtype,
        "--tp-size",
        str(server.cfg.tensor_parallel),
        "--sleep-on-idle",  # else an idle scheduler spins a CPU core, taken from the trainer beside it
    ]
    if server.device == "cpu":
        cmd += [
            "--device",
            "cpu",
            "--attention-backend",
            "torch_native",
            "--cuda-graph-backend-decode=disabled",
            "--cuda-graph-backend-prefill=disabled",
        ]
        if max_total_tokens is None and not any(a.startswith("--max-total-tokens") for a in user):
            max_total_tokens = CPU_DEFAULT_MAX_TOTAL_TOKENS
    else:
        cmd += ["--mem-fraction-static", str(server.cfg.mem_fraction_static),
                "--base-gpu-id", str(server.server_index * server.cfg.tensor_parallel)]
        if colocate:
            cmd.append("--enable-memory-saver")
    if max_total_tokens is not None:
        cmd += ["--max-total-tokens", str(max_total_tokens)]
    if server.api_key:
        cmd.append(f"--api-key={server.api_key}")  # one token: a key may begin with "-"
    if server.deterministic and server.device != "cpu" and DETERMINISTIC_FLAG not in user:
        cmd.append(DETERMINISTIC_FLAG)  # the CPU engine (torch_native) refuses it: CPU samples are not seeded
    if server.return_routes and ROUTES_FLAG not in user:
        cmd.append(ROUTES_FLAG)
    return cmd + user
