"""The embedded rollout engine: generation on a transformers model in the trainer's process (engine.py), its
decode loops (decoders.py, sampling.py), continuous batching for streams (continuous.py, slots.py), and the same
engine in a process of its own (process_engine.py, process_worker.py)."""

from megatron_dapo.rollout.embedded.engine import EmbeddedEngine

__all__ = ["EmbeddedEngine"]
