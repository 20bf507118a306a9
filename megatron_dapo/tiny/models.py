"""Tiny random Hugging Face models for tests and benchmarks: the one factory (no hub, no download).

    cfg = tiny_config("qwen2", vocab_size=200, tied=True)
    model = tiny_model("qwen3_moe", seed=0)
    path = save_tiny_model(tmp_path / "m", "llama", seed=1)   # config + safetensors (+ no tokenizer)

Families: qwen2 (QKV bias), qwen3 (QK-norm, no QKV bias), llama, qwen2_moe (shared expert),
qwen3_moe. Defaults are small enough for CPU tests (2 layers, hidden 64, 4 heads / 2 KV heads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FAMILIES = ("qwen2", "qwen3", "llama", "qwen2_moe", "qwen3_moe")

_COMMON: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0,
)
_MOE: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            decoder_sparse_step=1, norm_topk_prob=True)
_EXTRA: dict[str, dict[str, Any]] = {
    "qwen2": {"use_sliding_window": False},
    "qwen3": {"head_dim": 16, "use_sliding_window": False},
    "llama": {},
    "qwen2_moe": {**_MOE, "shared_expert_intermediate_size": 64, "use_sliding_window": False},
    "qwen3_moe": {**_MOE, "head_dim": 16, "use_sliding_window": False},
}


def _config_class(family: str) -> Any:
    import transformers

    names = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "llama": "LlamaConfig",
             "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig"}
    if family not in names:
        raise ValueError(f"unknown tiny model family {family!r}; valid: {', '.join(FAMILIES)}")
    return getattr(transformers, names[family])


def tiny_config(family: str = "qwen2", *, tied: bool = False, **overrides: Any) -> Any:
    """A transformers config of `family` with small defaults; any field can be overridden."""
    fields = {**_COMMON, **_EXTRA.get(family, {}), "tie_word_embeddings": tied, **overrides}
    return _config_class(family)(**fields)


def tiny_model(family: str = "qwen2", *, seed: int = 0, tied: bool = False, dtype: Any = None,
               **overrides: Any) -> Any:
    """A randomly initialised causal LM (eval mode) of `tiny_config(family, ...)`, seeded."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, tied=tied, **overrides))
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def save_tiny_model(path: str | Path, family: str = "qwen2", *, seed: int = 0, tied: bool = False,
                    dtype: Any = None, **overrides: Any) -> Path:
    """`tiny_model(...)` written as an HF folder (config.json + model.safetensors); returns the path."""
    path = Path(path)
    tiny_model(family, seed=seed, tied=tied, dtype=dtype, **overrides).save_pretrained(path)
    return path
