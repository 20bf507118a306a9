"""What the config tree's fields are made of: the named choices, the `knob` that carries a field's interval
and resume policy, and the error every config problem raises."""

from __future__ import annotations

import re
from dataclasses import field
from typing import Any, Literal

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
FilterMetric = Literal["acc", "score"]
OnExhausted = Literal["train_partial", "error"]
REWARD_FUNCTION = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
"""reward.name (or algo.policy_loss) of a user function: `module.path:function`."""
POLICY_LOSSES = ("dapo", "gspo", "cispo", "dr_grpo")
"""The built-in policy losses (algo/policy_losses.py registers them, in this order)."""
REWARDS = ("math_dapo", "math_verify")
"""The built-in verifiers (reward/verifiers.py)."""
PROMPT_TEMPLATES = ("auto", "dapo_math", "dapo_math_tool", "gsm8k", "raw")
"""data.prompt_template's built-in names (data/templates.py holds the templates)."""


def import_named(name: str, field_name: str, error: type[Exception]) -> Any:
    """The object `module.path:attr` names (None where the module has no `attr`). Importing runs user code: whatever
    it raises becomes `error`, on one line naming `field_name` and the module."""
    import importlib

    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise error(f"{field_name}={name!r}: cannot import {module_name!r} ({type(e).__name__}: {e})") from e
    return getattr(module, attr, None)


def knob(default: Any, interval: str | None = None, why: str = "", *, on_resume: bool = False) -> Any:
    """A field's default with what else the config knows of it: the valid interval of a number (interval
    notation, checked by validate(); `why` is shown when a value falls outside) and whether a resumed run
    may change it without being "a different run" (`on_resume`; a whole section: ON_RESUME = True)."""
    return field(default=default, metadata={"interval": interval, "why": why, "on_resume": on_resume})


class ConfigError(ValueError):
    """A config file or override that cannot be applied; the message names the key. `problems`: each
    problem found, when validate() found several (the message joins them on one line)."""

    def __init__(self, message: str, problems: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.problems = problems or (message,)


DEFAULT_BUCKET_MB = {"tensor": 512, "distributed": 256, "disk": 1024}
"""rollout.weight_sync_bucket_mb=0, per transport. tensor: slime's 512 MiB, one bucket copy on each
trainer GPU in the sync phase, read in place by the server; distributed: NCCL reaches link speed with far
smaller messages, and the servers allocate each bucket's receive buffer beside their resident KV cache;
disk: host memory and files only."""
