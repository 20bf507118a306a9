"""Partial rollout's carry: the groups a step aborted, with their samples so far, for the next step."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

from megatron_dapo.rollout.base import GroupRequest, SamplingParams
from megatron_dapo.types import Prompt, Sample


@dataclass
class PartialCarry:
    """Aborted groups (`GroupRequest.resume`: their samples so far); the next step submits them first."""

    groups: list[tuple[Prompt, GroupRequest]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.groups)

    def __iter__(self) -> Iterator[tuple[Prompt, GroupRequest]]:
        return iter(self.groups)

    @property
    def tokens(self) -> int:
        """Response tokens the carried groups take along."""
        return sum(r.resumed_tokens for _, r in self.groups)

    def state_dict(self) -> list[dict]:
        """Plain JSON (checkpoint trainer state)."""
        return [{"prompt": dataclasses.asdict(p), "request": dataclasses.asdict(r)} for p, r in self.groups]

    def load_state_dict(self, state: list[dict]) -> None:
        self.groups = []
        for item in state:
            r = dict(item["request"])
            r["sampling"] = SamplingParams(**r["sampling"])
            r["resume"] = tuple(Sample.from_dict(s) for s in r["resume"])
            self.groups.append((Prompt.from_dict(item["prompt"]), GroupRequest(**r)))

    @classmethod
    def from_state(cls, state: list[dict]) -> PartialCarry:
        carry = cls()
        carry.load_state_dict(state)
        return carry
