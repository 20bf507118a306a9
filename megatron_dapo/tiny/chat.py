"""A real chat tokenizer for tests, built here (no hub): a byte-level BPE trained in a second on a small
built-in corpus, Qwen2.5's special tokens, and Qwen2.5's chat template (the public one, tools branch
left out) with its default system prompt, which it injects when the messages carry none.

    tok = build_chat_tokenizer()                                # a PreTrainedTokenizerFast
    path = save_chat_model(tmp_path / "m", "qwen2", seed=0)     # tiny model + this tokenizer
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_dapo.tiny.models import save_tiny_model

QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB_SIZE = 512
"""Trained BPE size (specials included); a model for it needs vocab_size >= this."""
SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 8192,
                "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
"""SmolLM2-135M's architecture (Llama, tied embeddings): a real-size model for the CPU benchmarks."""

QWEN25_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\n" + QWEN_DEFAULT_SYSTEM + "<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\") %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def _corpus() -> list[str]:
    words = ("Solve the following math problem step by step. The last line of your response should be of the "
             "form Answer: $Answer (without quotes) where $Answer is the answer to the problem. Remember to put "
             "your answer on its own line after \"Answer:\". " + QWEN_DEFAULT_SYSTEM +
             " system user assistant What is Let's think step by step and output the final answer after ####.")
    sums = [f"{a}+{b}={a + b} {a}*{b}={a * b} {a}-{b}={a - b}" for a in range(0, 100, 7) for b in range(0, 100, 3)]
    return [words] * 50 + sums


def build_chat_tokenizer(vocab_size: int = VOCAB_SIZE) -> Any:
    """Byte-level BPE (every byte encodes) with <|endoftext|> = pad, <|im_end|> = eos, and the
    Qwen2.5 chat template; deterministic for a given vocab_size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(_corpus(), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = QWEN25_CHAT_TEMPLATE
    return tok


def save_chat_model(path: str | Path, family: str = "qwen2", *, seed: int = 0, **overrides: Any) -> Path:
    """A tiny random model (vocab = the tokenizer's) saved with the chat tokenizer: config.json,
    model.safetensors, tokenizer.json, tokenizer_config.json, chat_template.jinja."""
    tok = build_chat_tokenizer()
    overrides.setdefault("vocab_size", len(tok))
    ids = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "bos_token_id": None}
    path = save_tiny_model(path, family, seed=seed, **ids, **overrides)
    tok.save_pretrained(path)
    return path


def save_smollm2_shaped(path: str | Path, *, layers: int = 30, vocab: int = 49152, seed: int = 0) -> Path:
    """SmolLM2-135M's architecture (`layers` / `vocab` shrink it), random weights, with the chat tokenizer."""
    return save_chat_model(path, "llama", seed=seed, **{**SMOLLM2_135M, "num_hidden_layers": layers,
                                                         "vocab_size": vocab})
