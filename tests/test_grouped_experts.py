"""A MoE model's routed experts as one grouped GEMM per layer (Transformer Engine's GroupedLinear in megatron-core's
TEGroupedMLP) or as megatron-core's sequential loop: the choice (auto = grouped wherever the TE spec is in use; the
CPU keeps the loop), its refusal, its start-up line, and the parameter names of grouped experts (`weight<i>` per local
expert) mapped to the same HF tensors: a model named that way loads an HF checkpoint and exports it bit for bit.
`gpu`: tests/test_actor_gpu.py runs TE's grouped experts against the sequential ones."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.actor import model as model_mod
from megatron_dapo.actor.hf_mapping import Naming, full_shape, stage_rules
from megatron_dapo.config import Config
from megatron_dapo.tiny import save_tiny_model, tiny_config


def _spec(family: str = "qwen3_moe"):
    return model_mod.spec_from_hf(tiny_config(family))


def _cfg(experts: str = "auto", impl: str = "local") -> Config:
    cfg = Config()
    cfg.model.dtype, cfg.model.transformer_impl, cfg.model.moe_experts = "float32", impl, experts  # type: ignore[assignment]
    return cfg


def _fake_te(monkeypatch, grouped_linear: bool = True) -> None:
    monkeypatch.setattr(model_mod, "use_transformer_engine", lambda cfg: True)
    monkeypatch.setattr(model_mod, "_te_grouped_linear", lambda: grouped_linear)


def test_the_cpu_keeps_the_sequential_experts():
    cfg = _cfg()
    assert model_mod.grouped_experts(cfg.model, _spec()) is False
    assert model_mod.transformer_config(_spec(), cfg.model, cfg.parallel).moe_grouped_gemm is False
    assert model_mod.expert_kernel(cfg.model, _spec()) == \
        "sequential (megatron-core's loop over the local experts), model.moe_experts=auto"
    assert model_mod.expert_kernel(cfg.model, model_mod.spec_from_hf(tiny_config("qwen3"))) == ""


def test_grouped_is_refused_without_transformer_engine():
    with pytest.raises(model_mod.UnsupportedModelError, match="model.moe_experts=grouped .* Transformer Engine"):
        model_mod.grouped_experts(_cfg("grouped").model, _spec())


def test_transformer_engine_groups_the_experts_unless_told_not_to(monkeypatch):
    _fake_te(monkeypatch)
    cfg = _cfg()
    assert model_mod.transformer_config(_spec(), cfg.model, cfg.parallel).moe_grouped_gemm is True
    assert model_mod.expert_kernel(cfg.model, _spec()).startswith("grouped GEMM (Transformer Engine's GroupedLinear)")
    assert model_mod.grouped_experts(_cfg("sequential").model, _spec()) is False
    assert model_mod.grouped_experts(cfg.model, model_mod.spec_from_hf(tiny_config("qwen3"))) is False  # dense
    _fake_te(monkeypatch, grouped_linear=False)  # a TE without GroupedLinear: the loop, or a refusal when asked
    assert model_mod.grouped_experts(cfg.model, _spec()) is False
    with pytest.raises(model_mod.UnsupportedModelError):
        model_mod.grouped_experts(_cfg("grouped").model, _spec())


def test_grouped_names_map_the_same_hf_tensors_per_expert():
    """EP rank 1 of 2 holds experts 2 and 3 as GroupedLinear weights 0 and 1 (TEGroupedMLP's `weight<i>`), each
    made of the HF tensors of the sequential rule it replaces."""
    spec = _spec("qwen2_moe")
    seq = stage_rules(spec, te=True, ep_rank=1, ep_size=2)
    grp = stage_rules(spec, te=True, grouped=True, ep_rank=1, ep_size=2)
    by_hf = {(r.hf_names, r.kind, r.expert): r.megatron_name for r in grp}
    assert len(seq) == len(grp) and {(r.hf_names, r.kind, r.expert) for r in seq} == set(by_hf)
    assert by_hf[(("model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.experts.3.up_proj.weight"),
                  "fc1", 3)] == "decoder.layers.1.mlp.experts.linear_fc1.weight1"
    assert by_hf[(("model.layers.0.mlp.experts.2.down_proj.weight",), "row", 2)] == \
        "decoder.layers.0.mlp.experts.linear_fc2.weight0"
    assert Naming.of(r.megatron_name for r in grp) == Naming(te=True, grouped=True)
    assert Naming.of(r.megatron_name for r in stage_rules(spec)) == Naming(te=False, grouped=False)


class _Named(torch.nn.Module):
    """Parameters under dotted names, as a built model holds them."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        super().__init__()
        for name, shape in shapes.items():
            *path, leaf = name.split(".")
            module = self
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, torch.nn.Parameter(torch.full(shape, float("nan"))))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_a_grouped_model_loads_and_exports_the_hf_checkpoint_bit_for_bit(tmp_path, family):
    from megatron_dapo.actor.hf_io import export_hf_weights, load_hf_weights
    from megatron_dapo.hf_files import SafetensorsReader

    reader = SafetensorsReader(save_tiny_model(tmp_path, family, seed=3))
    spec = model_mod.spec_from_hf(tiny_config(family))
    rules = stage_rules(spec, te=True, grouped=True)
    model = _Named({r.megatron_name: full_shape(r, spec) for r in rules})
    load_hf_weights(model, reader, spec)
    assert all(torch.isfinite(p).all() for p in model.parameters())  # every parameter was written
    exported = dict(export_hf_weights(model, spec))
    assert sorted(exported) == sorted(reader.weight_map)
    for name, t in exported.items():
        assert torch.equal(t, reader.get(name)), name


def test_the_config_refuses_grouped_experts_with_the_local_spec():
    from megatron_dapo.config import ConfigError, validate

    with pytest.raises(ConfigError, match=r"model.moe_experts=grouped .*\(model.transformer_impl=local\)"):
        validate(_cfg("grouped"), 1)
    validate(_cfg("grouped", impl="auto"), 1)  # TE may be there: decided when the model is built
