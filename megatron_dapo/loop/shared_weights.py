"""The embedded engine's model on the actor's own parameters: one copy of the weights, not two.

In one process (TP = PP = 1) with the actor's parameters on the CPU in float32, most Hugging Face
tensors are plain views of a Megatron parameter: the embeddings and lm_head (the first vocab_size rows
of the padded table), the norms, o_proj, the gate / up halves of fc1 and down_proj. The engine's model
is built around those views, so an optimizer step is visible to the engine at once. Only the fused
QKV (Megatron interleaves q, k, v per KV group) is a copy; the weight sync copies it as before, and
`EmbeddedEngine.update_weights` skips a tensor that is already the engine's own memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from megatron_dapo.actor.actor import Actor
from megatron_dapo.actor.hf_mapping import Naming, megatron_to_hf, stage_rules


def can_share(actor: Actor, engine_dtype: torch.dtype = torch.float32) -> bool:
    """One process, whole model here, every parameter a CPU tensor of the engine's dtype."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        return False
    return all(p.device.type == "cpu" and p.dtype == engine_dtype for p in actor.module.parameters())


def actor_hf_tensors(actor: Actor) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of the whole model: a view of the actor's parameter where the layouts agree,
    else a contiguous copy."""
    params = dict(actor.module.named_parameters())
    naming, spec = Naming.of(params), actor.spec
    for rule in stage_rules(spec, 0, 1, te=naming.te, grouped=naming.grouped):
        param = params[rule.megatron_name].detach()
        full = param[: spec.vocab_size] if rule.kind == "vocab" else param
        for name, t in zip(rule.hf_names, megatron_to_hf(full, rule, spec)):
            yield name, t if t.is_contiguous() else t.contiguous()


def model_on_actor_weights(actor: Actor, hf_dir: str | Path) -> tuple[torch.nn.Module, int]:
    """A transformers causal LM of hf_dir's architecture whose parameters are `actor_hf_tensors`;
    returns it and how many of its parameter elements alias the actor's."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.initialization import no_init_weights

    config = AutoConfig.from_pretrained(hf_dir)
    with no_init_weights():  # parameters left uninitialised (untouched pages): replaced below
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if (Path(hf_dir) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(hf_dir)
    storages = {p.untyped_storage().data_ptr() for p in actor.module.parameters()}
    tensors = dict(actor_hf_tensors(actor))
    made: dict[str, torch.nn.Parameter] = {}
    for name, _ in list(model.named_parameters(remove_duplicate=False)):
        module_name, _, leaf = name.rpartition(".")
        if name == "lm_head.weight" and name not in tensors:  # tied: the embedding's own Parameter
            param = made["model.embed_tokens.weight"]
        elif name in tensors:
            param = torch.nn.Parameter(tensors[name], requires_grad=False)
        else:
            raise KeyError(f"{hf_dir}: the engine's parameter {name} has no actor tensor")
        made[name] = param
        setattr(model.get_submodule(module_name), leaf, param)
    shared = sum(p.numel() for p in model.parameters() if p.untyped_storage().data_ptr() in storages)
    return model.eval(), shared
