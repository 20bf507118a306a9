"""Endless, seeded and resumable iteration over prompt batches (the driver rank reads them all)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from megatron_dapo.types import Prompt

logger = logging.getLogger(__name__)

_STATE_KEYS = ("epoch", "position", "seed", "num_prompts")


class PromptIterator:
    """Yields batches of prompts forever, across epochs.

    Epoch e visits the prompts in the order `torch.randperm(n, generator=manual_seed(seed + e))`
    (or file order with `shuffle=False`). Each batch is the next `batch_size` prompts of that order.

    With `drop_last=True` the `n % batch_size` prompts left at the end of an epoch are not used in that
    epoch. With `drop_last=False` the last batch is completed with the first prompts of the same epoch's
    order, so every batch is full and divides across ranks.

    `state_dict()` records (epoch, position) where position counts the prompts of the current epoch's
    order already consumed; a new iterator given `load_state_dict(sd)` yields exactly the batches the
    original would have yielded next.
    """

    def __init__(
        self,
        prompts: list[Prompt],
        batch_size: int,
        *,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
    ):
        if not prompts:
            raise ValueError("PromptIterator needs at least one prompt")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if drop_last and batch_size > len(prompts):
            raise ValueError(
                f"batch_size {batch_size} exceeds the {len(prompts)} prompts with drop_last=True: "
                "no batch fits"
            )
        self.prompts = list(prompts)
        self.batch_size = batch_size
        self.seed = int(seed)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self._epoch = 0
        self._position = 0
        self._order: list[int] | None = None
        self._order_epoch = -1

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    @property
    def batches_per_epoch(self) -> int:
        n = len(self.prompts)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self._epoch:
            n = len(self.prompts)
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + self._epoch)
                self._order = torch.randperm(n, generator=generator).tolist()
            else:
                self._order = list(range(n))
            self._order_epoch = self._epoch
        assert self._order is not None
        return self._order

    def _epoch_exhausted(self) -> bool:
        n = len(self.prompts)
        return self._position + self.batch_size > n if self.drop_last else self._position >= n

    def _advance_epoch_if_done(self) -> None:
        if self._epoch_exhausted():
            self._epoch += 1
            self._position = 0

    def next_batch(self) -> list[Prompt]:
        """The next batch."""
        self._advance_epoch_if_done()
        order = self._epoch_order()
        n = len(order)
        batch = [self.prompts[order[(self._position + j) % n]] for j in range(self.batch_size)]
        self._position += self.batch_size
        self._advance_epoch_if_done()
        return batch

    def __next__(self) -> list[Prompt]:
        return self.next_batch()

    def __iter__(self) -> Iterator[list[Prompt]]:
        return self

    def state_dict(self) -> dict[str, int]:
        """JSON-serialisable position: {"epoch", "position", "seed", "num_prompts"} (plain ints)."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "num_prompts": len(self.prompts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`; ValueError if it is malformed or the dataset size changed."""
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"prompt iterator state is missing {missing}: {state}")
        values = {k: state[k] for k in _STATE_KEYS}
        if any(isinstance(v, bool) or not isinstance(v, int) for v in values.values()):
            raise ValueError(f"prompt iterator state must hold integers: {values}")
        if values["num_prompts"] != len(self.prompts):
            raise ValueError(
                f"prompt iterator state was saved for {values['num_prompts']} prompts but the dataset "
                f"now has {len(self.prompts)}: the dataset changed, so the resumed order would differ"
            )
        if values["epoch"] < 0 or values["position"] < 0:
            raise ValueError(f"prompt iterator state has a negative epoch or position: {values}")
        if values["seed"] != self.seed:
            logger.info("prompt iterator resumes with the saved seed %d (was %d)", values["seed"], self.seed)
        self.seed = values["seed"]
        self._epoch = values["epoch"]
        self._position = values["position"]
        self._order_epoch = -1
