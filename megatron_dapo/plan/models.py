"""Where the planner gets the model's architecture: --model-config, model.hf_dir, or a built-in table."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from megatron_dapo.config import Config

if TYPE_CHECKING:
    from megatron_dapo.actor.model import ModelSpec

# Architecture numbers of known models, as in their public Hugging Face config.json files
# (huggingface.co/Qwen/<name>/blob/main/config.json): same field names, so they go through the
# same `spec_from_hf` as a real checkpoint's config.
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen2.5-32B: 64 layers, hidden 5120, FFN 27648, 40 query heads, 8 KV heads (GQA),
    # vocab 152064, untied embeddings; 32.76 B parameters (65.5 GB of bf16 safetensors).
    "Qwen2.5-32B": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu",
                        hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                        max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-05,
                        tie_word_embeddings=False, use_sliding_window=False),
    # Qwen/Qwen2.5-7B: 28 layers, hidden 3584, FFN 18944, 28 query heads, 4 KV heads, vocab 152064, untied.
    "Qwen2.5-7B": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu",
                       hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-06,
                       tie_word_embeddings=False, use_sliding_window=False),
    # Qwen/Qwen2.5-1.5B: 28 layers, hidden 1536, FFN 8960, 12 query heads, 2 KV heads, vocab 151936, tied.
    "Qwen2.5-1.5B": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu",
                         hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-06,
                         tie_word_embeddings=True, use_sliding_window=False),
    # Qwen/Qwen3-8B: 36 layers, hidden 4096, FFN 12288, 32 query heads x head_dim 128, 8 KV heads, QK-norm,
    # vocab 151936, untied; 8.19 B parameters (6.95 B without the embedding and lm_head).
    "Qwen3-8B": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu",
                     hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                     rope_theta=1000000.0, rms_norm_eps=1e-06, tie_word_embeddings=False, attention_bias=False,
                     use_sliding_window=False),
    # Qwen/Qwen3-30B-A3B: 48 MoE layers, hidden 2048, 128 experts of FFN 768, top-8 (renormalised), no shared
    # expert, 32 query heads x 128, 4 KV heads, QK-norm, vocab 151936, untied; 30.53 B parameters, 3.35 B
    # activated per token (the model card's 30.5 B / 3.3 B).
    "Qwen3-30B-A3B": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_act="silu",
                          hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                          rms_norm_eps=1e-06, tie_word_embeddings=False, attention_bias=False,
                          use_sliding_window=False),
}


class PlanInputError(ValueError):
    """The model cannot be determined or is unsupported (exit 2)."""


def _known_model_key(hf_dir: str | None) -> str | None:
    if not hf_dir:
        return None
    name = Path(hf_dir.rstrip("/")).name.lower()
    for suffix in ("-instruct",):  # same architecture as the base model
        name = name.removesuffix(suffix)
    return next((k for k in KNOWN_MODELS if k.lower() == name), None)


def resolve_model(cfg: Config, model_config: str | Path | None = None) -> tuple[ModelSpec, str]:
    """(ModelSpec, where its numbers came from): --model-config, hf_dir/config.json, or the table."""
    from megatron_dapo.actor.model import UnsupportedModelError, spec_from_hf

    if model_config is not None:
        path = Path(model_config)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise PlanInputError(f"--model-config {model_config}: no such config.json")
        fields, source = json.loads(path.read_text()), str(path)
    elif cfg.model.hf_dir and (Path(cfg.model.hf_dir) / "config.json").is_file():
        path = Path(cfg.model.hf_dir) / "config.json"
        fields, source = json.loads(path.read_text()), str(path)
    else:
        key = _known_model_key(cfg.model.hf_dir)
        if key is None:
            raise PlanInputError(
                f"model.hf_dir={cfg.model.hf_dir!r} has no config.json here and is not a built-in model "
                f"({', '.join(KNOWN_MODELS)}): pass --model-config PATH/config.json")
        fields = KNOWN_MODELS[key]
        source = f"built-in table: {key} (model.hf_dir={cfg.model.hf_dir}/config.json not found here)"
    try:
        return spec_from_hf(SimpleNamespace(**fields)), source
    except (UnsupportedModelError, AttributeError, TypeError) as e:
        raise PlanInputError(f"{source}: {e}") from e
