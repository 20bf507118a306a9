"""Record every torch.distributed collective a run makes (its tensors' devices, its group and the backend the
group was created with), and hold the record against what the backends of a CUDA run accept.

On CPU every group is gloo, which takes any CPU tensor; on a GPU the same groups are NCCL (with gloo beside
it only where the default group says so), and NCCL has no CPU backend: a CPU tensor fed to it fails at the
first step ("No backend type associated with device type cpu"). `install()` patches torch.distributed's
public functions before megatron-core is imported; `refused(records, default_backend)` lists the calls a
CUDA run with that default-group backend would reject.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import torch.distributed as dist

TENSOR_OPS = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
              "reduce_scatter_tensor", "send", "recv", "isend", "irecv", "all_to_all", "all_to_all_single",
              "reduce", "gather", "scatter")
OBJECT_OPS = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list")
"""torch sends objects as tensors on the group's object device: the CPU whenever gloo is among its backends."""

records: list[dict] = []
_created: dict[int, str | None] = {}  # id(group) -> the backend asked for at creation (None: the default's)


def _devices(value) -> list[str]:
    if isinstance(value, torch.Tensor):
        return [value.device.type]
    if isinstance(value, (list, tuple)):
        return [d for v in value for d in _devices(v)]
    if isinstance(value, dist.P2POp):
        return _devices(value.tensor)
    return []


def _group_info(group) -> tuple[str, list[int]]:
    if group is None or group is dist.GroupMember.WORLD:
        return "default", list(range(dist.get_world_size()))
    backend = _created.get(id(group), "unknown")
    return "default" if backend is None else backend, dist.get_process_group_ranks(group)


def _recording(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        group = kwargs.get("group")
        if name == "batch_isend_irecv":
            ops = args[0] if args else kwargs["p2p_op_list"]
            devices, group = _devices(list(ops)), ops[0].group if ops else None
        elif name in OBJECT_OPS:
            devices = ["object"]
        elif name == "barrier":
            devices = ["barrier"]
        else:
            devices = _devices([*args[:2], *(kwargs.get(k) for k in ("tensor", "tensor_list", "output",
                                                                      "input", "output_tensor_list"))])
        if dist.is_initialized():
            backend, ranks = _group_info(group)
            records.append({"op": name, "devices": sorted(set(devices)), "group": backend, "ranks": ranks})
        return fn(*args, **kwargs)

    return wrapper


def _creating(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        group = fn(*args, **kwargs)
        if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
            _created[id(group)] = kwargs.get("backend", args[2] if len(args) > 2 else None)
        return group

    return wrapper


def install() -> None:
    """Patch torch.distributed (call before anything imports megatron-core or the trainer)."""
    from torch.distributed import distributed_c10d

    for name in (*TENSOR_OPS, *OBJECT_OPS, "barrier", "batch_isend_irecv"):
        setattr(dist, name, _recording(name, getattr(dist, name)))
    for name in ("isend", "irecv"):  # P2POp checks its op is c10d's own isend / irecv, by identity
        setattr(distributed_c10d, name, getattr(dist, name))
    dist.new_group = _creating(dist.new_group)


def save(path: Path) -> None:
    Path(path).write_text(json.dumps(records))


def backends_on_cuda(backend: str) -> dict[str, str]:
    """device type -> backend, for a group created with `backend` on a CUDA machine."""
    if ":" in backend:
        return dict(part.split(":") for part in backend.split(","))
    return {"cpu": "gloo", "cuda": "gloo"} if backend == "gloo" else {"cuda": backend}


def refused(recs: list[dict], default_backend: str) -> list[str]:
    """The calls a CUDA run would reject: a tensor on a device none of its group's backends serves (object
    collectives and barriers need the CPU only when the group has no CUDA backend), or tensors of one call
    on several devices."""
    bad = []
    for r in recs:
        served = backends_on_cuda(default_backend if r["group"] == "default" else r["group"])
        devices = [d for d in r["devices"] if d not in ("object", "barrier")]
        if len(devices) > 1:
            bad.append(f"{r['op']} on ranks {r['ranks']}: tensors on {devices}")
        for d in devices:
            if d not in served:
                bad.append(f"{r['op']} on ranks {r['ranks']} ({r['group']} group -> {served}): a {d} tensor")
    return sorted(set(bad))
