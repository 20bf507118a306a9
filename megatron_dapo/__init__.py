"""megatron-dapo: DAPO RL on a Megatron-core actor with SGLang rollouts."""

__version__ = "0.1.0"
