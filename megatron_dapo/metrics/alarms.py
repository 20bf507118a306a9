"""Alarms on the step's monitors: entropy collapse, length blow-up, a non-finite loss, no correct answer."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from megatron_dapo.config import LoggingConfig

log = logging.getLogger(__name__)


@dataclass
class Alarms:
    """Entropy collapse, length blow-up, non-finite loss and a step without one correct answer, each
    raised as a warning and an `alarm/*` scalar.

    no_correct_answers: accuracy 0 in every group of the step. With the soft overlong penalty such
    groups still differ in reward, so DAPO would then train on response length alone."""

    cfg: LoggingConfig
    max_response_len: int
    first_entropy: float | None = None
    raised: set[str] = field(default_factory=set)

    def check(self, scalars: dict[str, float]) -> dict[str, float]:
        out = {}
        ent = scalars.get("actor/entropy")
        if ent is not None and math.isfinite(ent):
            self.first_entropy = ent if self.first_entropy is None else self.first_entropy
            out["alarm/entropy_collapse"] = float(ent < self.cfg.entropy_collapse_frac * self.first_entropy)
        length = scalars.get("response_length/mean")
        if length is not None:
            out["alarm/length_blowup"] = float(length > self.cfg.length_blowup_frac * self.max_response_len)
        out["alarm/nonfinite_loss"] = float(scalars.get("actor/nonfinite", 0.0) > 0)
        acc = scalars.get("train/acc_mean")
        if acc is not None:
            out["alarm/no_correct_answers"] = float(acc == 0.0)
        for name, on in out.items():
            if on and name not in self.raised:
                log.warning("ALARM %s: %s", name, {k: v for k, v in scalars.items() if k.split("/")[0] in
                                                    ("actor", "response_length", "train")})
            (self.raised.add if on else self.raised.discard)(name)
        return out

    def state_dict(self) -> dict:
        return {"first_entropy": self.first_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.first_entropy = state.get("first_entropy")
