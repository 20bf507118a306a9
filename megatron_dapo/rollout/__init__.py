"""Rollout engines behind one interface: the embedded (in-process) engine, the same in a process of its own
(embedded/process_engine.py: what off-policy pipelining generates with), and SGLang servers.

`EmbeddedEngine` is imported lazily so that `megatron_dapo.rollout.base` stays light.
"""

from megatron_dapo.rollout.base import (
    EngineStateError,
    GenerationAborted,
    NonFiniteLogitsError,
    RolloutEngine,
    SamplingParams,
)

__all__ = ["EmbeddedEngine", "EngineStateError", "GenerationAborted", "NonFiniteLogitsError", "RolloutEngine",
           "SamplingParams"]


def __getattr__(name: str):
    if name == "EmbeddedEngine":
        from megatron_dapo.rollout.embedded import EmbeddedEngine

        return EmbeddedEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
