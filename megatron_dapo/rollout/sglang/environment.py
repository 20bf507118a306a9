"""Where an SGLang server process runs and what it inherits: its environment (cleaned of the trainer's
launcher variables and of allocator settings the memory saver cannot take), whether its python can run on
a GPU at all, and the address other nodes reach this node at.

No sglang import here: the trainer's python has none.
"""

from __future__ import annotations

import os
import subprocess

from megatron_dapo.network import _outgoing_address, is_loopback, node_address  # noqa: F401 - used here and by fleet.py

_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                       "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                       "MASTER_PORT")
"""What torchrun gives each trainer rank (and TORCHELASTIC_*): a server that inherits them builds its own
torch.distributed store as a client of the trainer's agent (TORCHELASTIC_USE_AGENT_STORE) and never starts."""
_ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def server_environment(environ: dict[str, str], *, own_python: bool, device: str) -> dict[str, str]:
    """The server's environment: ours without the launcher's rank variables, without another interpreter's
    PYTHONPATH, and without `expandable_segments` in the allocator config (torch_memory_saver cannot pause
    expandable segments); SGLANG_USE_CPU_ENGINE=1 exactly when it runs on the CPU."""
    env = {k: v for k, v in environ.items()
           if k not in _LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC_")}
    if not own_python:
        env.pop("PYTHONPATH", None)  # never leak this interpreter's packages into the server's
        env.pop("PYTHONHOME", None)
    for key in _ALLOC_CONF_VARIABLES:
        if key in env:
            options = [o.strip() for o in env[key].split(",")]
            kept = [o for o in options if o and not o.startswith("expandable_segments")]
            if kept:
                env[key] = ",".join(kept)
            else:
                del env[key]
    if device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    else:
        env.pop("SGLANG_USE_CPU_ENGINE", None)
    return env


CUDA_MODULES = ("sgl_kernel", "flashinfer")
"""What SGLang needs on a GPU beyond the CPU venv of tools/sglang_venv.sh (torch_memory_saver too when
colocated: --enable-memory-saver)."""


def missing_cuda_modules(python: str, *, memory_saver: bool) -> list[str]:
    """The modules of CUDA_MODULES (+ torch_memory_saver) that `python` cannot import (checked by name,
    in a clean environment, so our CPU shims stay off)."""
    names = [*CUDA_MODULES, *(("torch_memory_saver",) if memory_saver else ())]
    probe = ("import importlib.util, sys; "
             "print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))")
    env = server_environment(dict(os.environ), own_python=False, device="cuda")
    try:
        out = subprocess.run([python, "-c", probe, *names], capture_output=True, text=True, env=env,
                             timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        return [f"a working interpreter ({e})"]
    if out.returncode != 0:
        return [f"a working interpreter (exit {out.returncode}: {out.stderr.strip()[-200:]})"]
    return out.stdout.split()


# ------------------------------------------------------------------------------------- node address
# (megatron_dapo/network.py: the trainer's gloo sockets use the same address)


def check_node_addresses(nodes: list[tuple[int, str, str]]) -> None:
    """(node rank, address, host name) of every rank: a loopback address cannot be reached from another
    host, so a job on several hosts with one refuses to start (one line naming the node)."""
    if len({host for _, _, host in nodes}) < 2:
        return  # one host (or "nodes" simulated on one machine): loopback reaches every server
    for node, addr, host in nodes:
        if is_loopback(addr):
            raise RuntimeError(f"node {node} ({host}) would be reached at the loopback address {addr}: set "
                               "DAPO_NODE_ADDR to an address the other nodes can reach")
