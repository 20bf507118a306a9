"""The tiny testbed: small random Hugging Face models (`models`) and the tiny base policy of the CPU run."""

from megatron_dapo.tiny.models import FAMILIES, save_tiny_model, tiny_config, tiny_model

__all__ = ["FAMILIES", "save_tiny_model", "tiny_config", "tiny_model"]
