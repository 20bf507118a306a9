"""The tiny base's character-level tokenizer: one token per printable ASCII character and newline, the
answer marker "Answer:" as one token, and <pad>, <eos> (the stop token), <unk>; no BOS and NO chat
template, so prompts render as the plain message text ("37+45="), see `megatron_dapo.data.render`."""

from __future__ import annotations

import json
import re
import string
from pathlib import Path
from typing import Any

PAD_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)
CHARACTERS = tuple(c for c in string.printable if c not in "\t\r\x0b\x0c")
"""Printable ASCII (digits, letters, punctuation incl. + - * = :, space) and newline: one token each."""
WORDS = ("Answer:",)
"""Whole-word tokens: the answer marker is one token, so a response "Answer: 82" is 4 tokens + <eos>."""


def build_char_tokenizer(model_max_length: int = 64) -> Any:
    """A character-level `PreTrainedTokenizerFast`: <pad>=0, <eos>=1, <unk>=2, one id per character of
    `CHARACTERS`, then the `WORDS` ("Answer:"), each one token wherever it occurs.

    No BOS and no chat template; `decode` joins tokens without separators; characters outside
    `CHARACTERS` encode as <unk>.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    pieces = "|".join(re.escape(word) for word in WORDS) + r"|[\s\S]"  # a whole word, else one character
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(pieces), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=model_max_length,
    )


def save_tokenizer(tokenizer: Any, out: Path) -> None:
    """`save_pretrained`, plus what older transformers (and other loaders) look for.

    transformers 5 records its own backend class name and no special_tokens_map.json; the generic
    "PreTrainedTokenizerFast" class loads in both 4.x and 5.x.
    """
    tokenizer.save_pretrained(out)
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.pop("chat_template", None)
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    special = {"pad_token": PAD_TOKEN, "eos_token": EOS_TOKEN, "unk_token": UNK_TOKEN}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
