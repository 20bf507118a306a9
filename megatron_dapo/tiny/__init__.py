"""The tiny testbed: small random Hugging Face models (`models`) and the tiny base policy of the CPU run
(`base`: `ensure_tiny_base`, `build_tiny_base`; CLI: `python -m megatron_dapo.tiny`)."""

from megatron_dapo.tiny.base import OutputExistsError, build_tiny_base, ensure_tiny_base
from megatron_dapo.tiny.models import FAMILIES, save_tiny_model, tiny_config, tiny_model
from megatron_dapo.tiny.warmstart import Settings

__all__ = ["FAMILIES", "OutputExistsError", "Settings", "build_tiny_base", "ensure_tiny_base", "save_tiny_model",
           "tiny_config", "tiny_model"]
