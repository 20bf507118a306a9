"""Move weights between a Megatron GPTModel shard and Hugging Face safetensors, one tensor at a time.

Loading reads only what this rank holds (its TP shard, its pipeline stage's layers, its expert-parallel
rank's experts). Exporting is collective: TP shards are all-gathered (over the expert TP group for
routed experts) and each routed expert is broadcast from the expert-parallel rank that holds it, so every
rank of a pipeline stage yields every HF tensor of the stage, in the same order.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dapo import parallel
from megatron_dapo.actor.hf_mapping import (
    Naming,
    TensorRule,
    expected_hf_shape,
    full_shape,
    hf_to_megatron,
    megatron_to_hf,
    shard,
    stage_rules,
    unshard,
)
from megatron_dapo.actor.model import ModelSpec
from megatron_dapo.hf_files import HFCheckpointError, SafetensorsReader, copy_aux_files


def _tp(rule: TensorRule) -> tuple[int, int]:
    """(rank, size) of the group that shards this tensor: TP, or expert TP for a routed expert."""
    if not dist.is_initialized():
        return 0, 1
    if rule.expert is not None:
        return parallel.expert_tp_rank(), parallel.expert_tp_size()
    return parallel.tp_rank(), parallel.tp_size()


def _stage() -> tuple[int, int]:
    return (parallel.pp_rank(), parallel.pp_size()) if dist.is_initialized() else (0, 1)


def _ep() -> tuple[int, int]:
    return (parallel.ep_rank(), parallel.ep_size()) if dist.is_initialized() else (0, 1)


def _rules_for(model: torch.nn.Module, spec: ModelSpec) -> list[TensorRule]:
    """This rank's rules (its stage, its experts), checked against the model's parameter names."""
    (pp_rank, pp_size), (ep_rank, ep_size) = _stage(), _ep()
    names = {n for n, _ in model.named_parameters()}
    naming = Naming.of(names)
    rules = stage_rules(spec, pp_rank, pp_size, te=naming.te, grouped=naming.grouped, ep_rank=ep_rank, ep_size=ep_size)
    mapped = {r.megatron_name for r in rules}
    if names != mapped:
        raise HFCheckpointError(f"model/mapping mismatch: unmapped params {sorted(names - mapped)[:5]}, "
                                f"missing params {sorted(mapped - names)[:5]}")
    return rules


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, reader: SafetensorsReader, spec: ModelSpec) -> int:
    """Copy HF tensors into this rank's shard of `model`; returns bytes read. Checks every shape."""
    params = dict(model.named_parameters())
    total = 0
    for rule in _rules_for(model, spec):
        tensors = []
        for name in rule.hf_names:
            t = reader.get(name)
            if tuple(t.shape) != expected_hf_shape(name, spec):
                raise HFCheckpointError(f"{name}: shape {tuple(t.shape)} does not match the config "
                                        f"(expected {expected_hf_shape(name, spec)})")
            tensors.append(t)
            total += t.numel() * t.element_size()
        param = params[rule.megatron_name]
        tp_rank, tp_size = _tp(rule)
        piece = shard(hf_to_megatron(tensors, rule, spec), rule, tp_rank, tp_size, _padded_rows(param, rule, tp_size))
        param.copy_(piece.to(param.dtype))
    return total


def _padded_rows(param: torch.Tensor, rule: TensorRule, tp_size: int) -> int:
    return param.shape[0] * tp_size if rule.kind == "vocab" else 0


@torch.no_grad()
def export_hf_weights(model: torch.nn.Module, spec: ModelSpec, dtype: torch.dtype | None = None,
                      *, grads: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for this pipeline stage, gathering TP shards and routed experts from
    their expert-parallel ranks (every rank of the stage yields every tensor).

    With grads=True, yields the accumulated gradients (Megatron's `main_grad`) in HF layout instead.
    Tensors may alias live parameters or grad buffers: consume or copy them before the next update.
    """
    params = dict(model.named_parameters())
    mine = {(r.expert, r.hf_names): params[r.megatron_name] for r in _rules_for(model, spec)}
    like = _data(next(iter(params.values())), grads)
    naming = Naming.of(params)
    for rule in stage_rules(spec, *_stage(), te=naming.te, grouped=naming.grouped):  # the stage's HF view: all experts
        if not rule.exported:
            continue
        param = mine.get((rule.expert, rule.hf_names))
        local = None if param is None else _data(param, grads)
        full = _full_tensor(local, rule, spec) if rule.expert is None else _full_expert(local, rule, spec, like)
        for name, t in zip(rule.hf_names, megatron_to_hf(full, rule, spec)):
            yield name, (t if dtype is None else t.to(dtype)).contiguous()


def _data(param: torch.Tensor, grads: bool) -> torch.Tensor:
    return (param.main_grad if grads else param).detach()


def _full_tensor(local: torch.Tensor, rule: TensorRule, spec: ModelSpec) -> torch.Tensor:
    if rule.kind == "replicated":
        return local
    group = (parallel.expert_tp_group() if rule.expert is not None else parallel.tp_group()) \
        if dist.is_initialized() else None
    return unshard(_gather(local, _tp(rule)[1], group), rule, spec.vocab_size)


def _full_expert(local: torch.Tensor | None, rule: TensorRule, spec: ModelSpec, like: torch.Tensor) -> torch.Tensor:
    """A routed expert's full tensor on every rank: gathered over expert TP by the expert-parallel rank
    that holds it, then broadcast to the other expert-parallel ranks."""
    full = None if local is None else _full_tensor(local, rule, spec)
    ep_rank, ep_size = _ep()
    if ep_size == 1:
        return full
    owner = rule.expert // (spec.moe.num_experts // ep_size)
    if full is None:
        full = torch.empty(full_shape(rule, spec), dtype=like.dtype, device=like.device)
    dist.broadcast(full, dist.get_process_group_ranks(parallel.ep_group())[owner], group=parallel.ep_group())
    return full


def _gather(local: torch.Tensor, size: int, group) -> list[torch.Tensor]:
    if size == 1:
        return [local]
    out = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(out, local.contiguous(), group=group)
    return out


def model_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype of the model's weights (what an export moves unless asked otherwise)."""
    return next(module.parameters()).dtype


def hf_weight_stream(module: torch.nn.Module, spec: ModelSpec, dtype: torch.dtype | None = None, *,
                     received: Callable[[int, int], None] | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor of the model, in order, on every rank of each pipeline (collective), in `dtype`
    (default: the model's own).

    This stage's tensors come from `export_hf_weights` (TP all-gather); other stages' tensors are
    broadcast from their owner inside the pipeline group, one tensor at a time; `received(source global
    rank, bytes)` is told of each.
    """
    dtype = dtype or model_dtype(module)
    pp_size = parallel.pp_size() if dist.is_initialized() else 1
    if pp_size == 1:
        for name, t in export_hf_weights(module, spec, dtype):
            yield name, t
        return
    me, ranks = parallel.pp_rank(), dist.get_process_group_ranks(parallel.pp_group())
    for stage in range(pp_size):
        if stage == me:
            for name, t in export_hf_weights(module, spec, dtype):
                dist.broadcast(t, ranks[stage], group=parallel.pp_group())
                yield name, t
        else:
            for rule in stage_rules(spec, stage, pp_size):
                for name in rule.hf_names if rule.exported else ():
                    t = torch.empty(expected_hf_shape(name, spec), dtype=dtype, device=parallel.device())
                    dist.broadcast(t, ranks[stage], group=parallel.pp_group())
                    if received is not None:
                        received(ranks[stage], t.numel() * t.element_size())
                    yield name, t


def save_hf_checkpoint(module: torch.nn.Module, spec: ModelSpec, out_dir: str | Path, src_hf_dir: str | Path | None,
                       *, dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Collective: write the model as HF safetensors (sharded above max_shard_bytes, with an index)
    on global rank 0, streaming one shard at a time, in `dtype` (default: the model's); config.json and every
    auxiliary file (tokenizer, chat template, generation config) come from src_hf_dir."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    main = parallel.global_rank() == 0 if dist.is_initialized() else True
    if main:
        out.mkdir(parents=True, exist_ok=True)
    buf: dict[str, torch.Tensor] = {}
    files: list[str] = []
    size, weight_map = 0, {}

    def flush() -> None:
        nonlocal buf, size
        if buf and main:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(buf, str(out / name), metadata={"format": "pt"})
            files.append(name)
            weight_map.update({k: name for k in buf})
        buf, size = {}, 0

    for name, t in hf_weight_stream(module, spec, dtype):
        nbytes = t.numel() * t.element_size()
        if buf and size + nbytes > max_shard_bytes:
            flush()
        if main:
            buf[name] = t.detach().to("cpu", copy=True).contiguous()
        size += nbytes
    flush()
    if main:
        _finalize_shards(out, files, weight_map)
        if src_hf_dir is not None:
            copy_aux_files(src_hf_dir, out, with_config=True)
    return out


def _finalize_shards(out: Path, files: list[str], weight_map: dict[str, str]) -> None:
    if len(files) == 1:
        (out / files[0]).rename(out / "model.safetensors")
        return
    total = sum((out / f).stat().st_size for f in files)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
