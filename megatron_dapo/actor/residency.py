"""The actor's device state in the colocated hybrid engine: what it holds on the device, and its sleep and wake
around the rollout (the same code on CPU and GPU)."""

from __future__ import annotations

from typing import Any

import torch

from megatron_dapo import parallel
from megatron_dapo.offload import HostOffload, device_bytes


class Residency:
    """Mixed into Actor: needs `module`, `optimizer`, `_buffers()` and `_offload` (a HostOffload)."""

    module: torch.nn.Module
    optimizer: Any
    _offload: HostOffload

    def _buffers(self) -> list[Any]:
        raise NotImplementedError

    STATE = ("weights", "main_grads", "optimizer")

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The actor's device state by component (the planner's names): parameters (and Megatron's flat
        parameter buffers), main-grad buffers, optimizer state (fp32 master copies, Adam moments)."""
        buffers = self._buffers()
        weights = [*self.module.parameters(), *(b.param_data for b in buffers if b.param_data is not None)]
        optim: list[torch.Tensor] = []
        for opt in _torch_optimizers(self.optimizer):
            optim += [p for g in opt.param_groups for p in g["params"]]
            optim += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        return {"weights": weights, "main_grads": [b.grad_data for b in buffers], "optimizer": optim}

    def device_bytes(self) -> dict[str, int]:
        """Bytes of each state component resident on this rank's device now (0 for all while asleep)."""
        return device_bytes(self.state_tensors(), parallel.device())

    def resident(self) -> tuple[str, ...]:
        """The state components on this rank's device now (the others are in host memory)."""
        return tuple(c for c in self.STATE if c not in self._offload.offloaded_groups)

    @property
    def asleep(self) -> bool:
        """Nothing of the actor's state on the device."""
        return not self.resident()

    def sleep(self, parts: tuple[str, ...] = STATE) -> None:
        """Free the device of `parts` (default all, for the rollout engine): weights and optimizer state go to
        host memory, the main grads are dropped (every update starts from zeroed grads). Same code on CPU
        and GPU."""
        parts = tuple(p for p in parts if p in self.resident())
        if not parts:
            return
        self._offload.offload(self.state_tensors(), drop=("main_grads",), only=parts)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def wake(self, parts: tuple[str, ...] = STATE) -> None:
        self._offload.reload(only=parts)

    def _check_awake(self, needs: tuple[str, ...] = STATE) -> None:
        if missing := [p for p in needs if p not in self.resident()]:
            raise RuntimeError(f"actor's {', '.join(missing)} are in host memory (rollout phase): call wake() "
                               "before computing")


def _torch_optimizers(opt: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron (chained) optimizer."""
    if hasattr(opt, "chained_optimizers"):
        return [o for c in opt.chained_optimizers for o in _torch_optimizers(c)]
    inner = getattr(opt, "optimizer", None)
    return [inner] if isinstance(inner, torch.optim.Optimizer) else []
