"""Device residency of named groups of tensors: move their storage to a host copy and back, in place.

`storage.resize_(0)` frees a tensor's memory while every view of it stays the same Python object
(Megatron's parameters and main grads are views into flat buffers, optimizers key their state by
parameter): `reload` resizes the storage and copies the host bytes back. On CPU the device copy and
the host copy are distinct allocations as well, so a sleeping component really holds nothing but its
host copy there too, and `device_bytes` counts residency with the same code on every device.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch


def _storage_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def unique_storages(groups: Mapping[str, Iterable[torch.Tensor]]) -> dict[str, list[torch.UntypedStorage]]:
    """Each group's storages that no earlier group (or earlier tensor) already holds; empty ones dropped."""
    seen: set[int] = set()
    out: dict[str, list[torch.UntypedStorage]] = {}
    for name, tensors in groups.items():
        out[name] = []
        for t in tensors:
            st = t.untyped_storage()
            if st.nbytes() == 0 or st.data_ptr() in seen:
                continue
            seen.add(st.data_ptr())
            out[name].append(st)
    return out


def device_bytes(groups: Mapping[str, Iterable[torch.Tensor]], device: torch.device) -> dict[str, int]:
    """Bytes each group holds on `device` (a storage shared by two groups counts for the first)."""
    return {name: sum(st.nbytes() for st in storages if st.device.type == device.type)
            for name, storages in unique_storages(groups).items()}


def own_storage(params: Iterable[torch.nn.Parameter]) -> None:
    """Give parameters whose memory torch cannot free (e.g. mmap'd from safetensors) a copy of their own."""
    for p in params:
        if not p.untyped_storage().resizable():
            p.data = p.data.clone()


LOST_BYTE = 0xFF
"""What a lost region holds when it comes back: all bits set, NaN in every floating dtype (fp32, bf16, fp16)."""


@dataclass
class _Held:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # None: the values are not kept (`fill` on reload)
    fill: int = 0


class HostOffload:
    """Offloads named groups of tensors to host memory and brings them back, all or some of them; host
    buffers are reused."""

    def __init__(self) -> None:
        self._held: dict[str, list[_Held]] = {}
        self._host: dict[tuple[str, int], torch.Tensor] = {}  # (group, slot) -> host buffer, reused

    @property
    def offloaded(self) -> bool:
        return bool(self._held)

    @property
    def offloaded_groups(self) -> set[str]:
        return set(self._held)

    def offload(self, groups: Mapping[str, Iterable[torch.Tensor]], *, drop: Iterable[str] = (),
                lose: Iterable[str] = (), only: Iterable[str] | None = None) -> int:
        """Free the groups' storages (a copy of their bytes kept on the host unless the group is in `drop`:
        zeros on reload, or in `lose`: NaN on reload, as a CUDA memory saver's paused region comes back
        without a backup); returns the bytes freed. `only`: just these groups (a storage two groups share
        belongs to the first of `groups`). A group offloaded twice before its `reload` is refused."""
        lose = set(lose)
        drop = set(drop) | lose
        wanted = set(groups) if only is None else set(only)
        if again := sorted(wanted & set(self._held)):
            raise RuntimeError(f"HostOffload.offload: {', '.join(again)} already offloaded; reload() first")
        freed = 0
        for name, storages in unique_storages(groups).items():
            if name not in wanted:
                continue
            held = self._held[name] = []
            for slot, st in enumerate(storages):
                if not st.resizable():
                    raise RuntimeError(f"HostOffload: a {name} tensor's memory cannot be freed (not "
                                       "resizable, e.g. mmap'd): give it its own storage (own_storage)")
                n = st.nbytes()
                host = None if name in drop else self._host_buffer((name, slot), n, st.device)
                if host is not None:
                    host.copy_(_storage_view(st), non_blocking=False)
                st.resize_(0)
                held.append(_Held(st, n, host, LOST_BYTE if name in lose else 0))
                freed += n
        return freed

    def reload(self, only: Iterable[str] | None = None) -> None:
        """Reallocate the offloaded storages (of `only`'s groups) and restore their bytes (dropped groups:
        zeros; lost: NaN)."""
        for name in list(self._held) if only is None else [g for g in only if g in self._held]:
            for held in self._held.pop(name):
                held.storage.resize_(held.nbytes)
                view = _storage_view(held.storage)
                if held.host is None:
                    view.fill_(held.fill)
                else:
                    view.copy_(held.host, non_blocking=False)

    def _host_buffer(self, slot: tuple[str, int], nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self._host.get(slot)
        if buf is None or buf.numel() != nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
            self._host[slot] = buf
        return buf
