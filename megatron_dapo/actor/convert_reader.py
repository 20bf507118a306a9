"""Read full (unsharded) Megatron tensors out of a distributed checkpoint, whatever TP/PP wrote it.

A dist checkpoint stores every tensor under its global shape, so one process reads any layout. Keys
are found for both layer specs (Transformer Engine fuses the norms into the next linear; the local
spec keeps them apart) and for both per-layer and stacked-layer key styles; routed experts are stacked
along a second axis (`decoder.layers.mlp.experts.experts.linear_fc1.weight` [layers, experts, ...],
whatever expert parallel wrote them). Every shape is checked against config.json before a byte is read.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_dapo.actor.hf_mapping import TensorRule, expected_hf_shape, full_shape, stage_rules
from megatron_dapo.actor.model import ModelSpec
from megatron_dapo.cli import UserError

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.\d+\.(.+)$")
# Checkpoint keys of the local layer spec where Transformer Engine fuses the norm into the next linear.
_LOCAL_KEYS = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
               "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}
_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")


@dataclass
class Entry:
    rule: TensorRule   # TE naming, PP=1
    key: str           # dist-checkpoint key
    layer: int | None  # index into the stacked layer axis, None if the key holds this tensor alone
    nbytes_out: int = 0

    @property
    def index(self) -> tuple[int, ...]:
        """Indices into the stacked leading axes (layer, then expert for a routed expert)."""
        return tuple(i for i in (self.layer, self.rule.expert) if i is not None)


class CheckpointReader:
    """Reads full (unsharded) Megatron tensors from a dist checkpoint by rule, checked against the config."""

    def __init__(self, ckpt: Path, spec: ModelSpec):
        from megatron.core import dist_checkpointing

        self.ckpt, self.spec = ckpt, spec
        try:
            self.meta = dist_checkpointing.load_tensors_metadata(str(ckpt))
        except Exception as e:  # a damaged .metadata / metadata.json
            raise UserError(f"--load {ckpt}: cannot read the checkpoint metadata ({e})") from e
        self.entries = [self._locate(rule) for rule in stage_rules(spec, 0, 1, te=True)]
        used = {e.key for e in self.entries}
        extra = sorted(k for k in self.meta if k.startswith(_MODEL_PREFIXES) and k not in used
                       and not (k == "output_layer.weight" and spec.tied_embeddings))
        if extra:
            raise UserError(f"{ckpt}: stores {len(extra)} model tensor(s) that config.json does not "
                            f"describe, e.g. {extra[0]} (was it written for a different model?)")
        self.dtype: torch.dtype = self.meta[self.entries[0].key].dtype

    def _locate(self, rule: TensorRule) -> Entry:
        key, layer = None, None
        m = _LAYER.match(rule.megatron_name)
        if m is None:
            key = rule.megatron_name if rule.megatron_name in self.meta else None
        elif rule.expert is not None:  # only the stacked style: [layers, experts, ...]
            key = f"decoder.layers.mlp.experts.experts.{_EXPERT.match(m.group(2)).group(1)}"
            key, layer = (key, int(m.group(1))) if key in self.meta else (None, None)
        else:
            i, rest = int(m.group(1)), m.group(2)
            for name in (rest, _LOCAL_KEYS.get(rest)):
                if name and f"decoder.layers.{i}.{name}" in self.meta:
                    key = f"decoder.layers.{i}.{name}"
                elif name and f"decoder.layers.{name}" in self.meta:
                    key, layer = f"decoder.layers.{name}", i
                if key:
                    break
        if key is None:
            raise UserError(f"{self.ckpt}: no tensor for {rule.megatron_name} "
                            f"(HF {', '.join(rule.hf_names)}); config.json says "
                            f"num_hidden_layers={self.spec.num_layers}, "
                            f"tie_word_embeddings={self.spec.tied_embeddings}, "
                            f"qkv bias={self.spec.qkv_bias}")
        self._check_shape(rule, key, layer)
        return Entry(rule, key, layer)

    def _check_shape(self, rule: TensorRule, key: str, layer: int | None) -> None:
        shape = tuple(self.meta[key].global_shape)
        if layer is not None:
            if shape[0] != self.spec.num_layers:
                raise UserError(f"{self.ckpt}: the checkpoint has {shape[0]} layers, config.json says "
                                f"num_hidden_layers={self.spec.num_layers}")
            shape = shape[1:]
        if rule.expert is not None:
            if shape[0] != self.spec.moe.num_experts:
                raise UserError(f"{self.ckpt}: the checkpoint has {shape[0]} experts per layer, config.json "
                                f"says num_experts={self.spec.moe.num_experts}")
            shape = shape[1:]
        want = full_shape(rule, self.spec)
        if rule.kind == "vocab":
            ok = shape[1:] == want[1:] and shape[0] >= want[0]
        else:
            ok = shape == want
        if not ok:
            raise UserError(f"{self.ckpt}: {key} has shape {list(shape)} but config.json implies "
                            f"{list(want)} "
                            f"({'rows >= vocab_size, ' if rule.kind == 'vocab' else ''}HF "
                            f"{', '.join(rule.hf_names)}; hidden_size={self.spec.hidden_size}, "
                            f"intermediate_size={self.spec.ffn_hidden_size}, heads={self.spec.num_heads}, "
                            f"kv_heads={self.spec.num_kv_heads}, vocab_size={self.spec.vocab_size})")

    def numel(self) -> int:
        """Elements of the HF tensors the checkpoint converts to."""
        return sum(math.prod(expected_hf_shape(n, self.spec)) for n in self.rules_hf_names())

    def rules_hf_names(self) -> list[str]:
        return [n for e in self.entries for n in e.rule.hf_names]

    def load(self, entries: list[Entry]) -> dict[str, torch.Tensor]:
        """megatron name -> full tensor (vocab padding removed), in one read of the checkpoint."""
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing import ShardedTensor

        request = {}
        for e in entries:
            st, stacked = self.meta[e.key], len(e.index)
            buf = torch.empty((1,) * stacked + tuple(st.global_shape[stacked:]), dtype=st.dtype)
            offsets = [(axis, i, st.global_shape[axis]) for axis, i in enumerate(e.index)]
            request[e.rule.megatron_name] = ShardedTensor.from_rank_offsets(e.key, buf, *offsets, replica_id=0)
        loaded = dist_checkpointing.load(request, str(self.ckpt), validate_access_integrity=False)
        out = {}
        for e in entries:
            t = loaded[e.rule.megatron_name]
            t = t.reshape(t.shape[len(e.index):])
            out[e.rule.megatron_name] = t[: self.spec.vocab_size] if e.rule.kind == "vocab" else t
        return out


def plan_shards(entries: list[Entry], spec: ModelSpec, itemsize: int, max_bytes: int) -> list[list[Entry]]:
    """Greedy packing in model order; a rule's HF tensors (e.g. q, k, v) stay in one file."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        e.nbytes_out = sum(math.prod(expected_hf_shape(n, spec)) for n in e.rule.hf_names) * itemsize
        if shards[-1] and size + e.nbytes_out > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes_out
    return shards
