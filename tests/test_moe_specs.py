"""Qwen3 / Qwen3-MoE / Qwen2-MoE without a process group: model specs from config.json, refused configs
and layouts named by field, expert-parallel parameter rules and HF names, checkpoint views of fused
experts, and the planner's MoE parameter counts and expert layouts (hand arithmetic from the public
configs). The multi-rank tests of the same families: tests/test_qwen3_moe.py."""

from pathlib import Path

import pytest
import torch

from megatron_dapo.tiny import tiny_model


def test_specs_of_the_new_families():
    from megatron_dapo.actor.model import spec_from_hf
    from megatron_dapo.tiny import tiny_config

    q3 = spec_from_hf(tiny_config("qwen3", head_dim=24))
    assert (q3.family, q3.qk_norm, q3.qkv_bias, q3.head_dim, q3.moe) == ("qwen3", True, False, 24, None)
    q3m = spec_from_hf(tiny_config("qwen3_moe"))
    assert q3m.qk_norm and not q3m.qkv_bias
    assert (q3m.moe.num_experts, q3m.moe.top_k, q3m.moe.ffn_hidden_size, q3m.moe.norm_topk_prob,
            q3m.moe.shared_expert_size) == (4, 2, 32, True, 0)
    q2m = spec_from_hf(tiny_config("qwen2_moe", norm_topk_prob=False))
    assert (q2m.qk_norm, q2m.qkv_bias, q2m.moe.shared_expert_size, q2m.moe.norm_topk_prob) == (False, True, 64, False)


@pytest.mark.parametrize("family, kw, field", [
    ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ("qwen2_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
    ("qwen3", {"attention_bias": True}, "attention_bias"),
    ("qwen3_moe", {"num_experts_per_tok": 5}, "num_experts_per_tok"),
])
def test_unsupported_moe_and_qwen3_configs_name_the_field(family, kw, field):
    from megatron_dapo.actor.model import UnsupportedModelError, spec_from_hf
    from megatron_dapo.tiny import tiny_config

    with pytest.raises(UnsupportedModelError, match=field):
        spec_from_hf(tiny_config(family, **kw))


def test_megatron_config_has_no_auxiliary_loss():
    from megatron_dapo.actor.model import spec_from_hf, transformer_config
    from megatron_dapo.config import Config
    from megatron_dapo.tiny import tiny_config

    cfg = Config()
    cfg.model.dtype = "float32"
    tc = transformer_config(spec_from_hf(tiny_config("qwen2_moe", norm_topk_prob=False)), cfg.model, cfg.parallel)
    assert (tc.moe_aux_loss_coeff, tc.moe_z_loss_coeff, tc.moe_router_load_balancing_type) == (0.0, None, "none")
    assert tc.moe_router_pre_softmax and tc.moe_shared_expert_gate and tc.moe_shared_expert_intermediate_size == 64
    assert tc.qk_layernorm is False and tc.num_moe_experts == 4 and tc.moe_router_topk == 2


@pytest.mark.parametrize("tp, ep, field", [(4, 1, "moe_intermediate_size=30"), (1, 3, "num_experts=4"),
                                           (1, 2, None)])
def test_expert_layout_must_divide(tp, ep, field):
    from megatron_dapo.actor.model import UnsupportedModelError, spec_from_hf, validate_layout
    from megatron_dapo.tiny import tiny_config

    spec = spec_from_hf(tiny_config("qwen3_moe", moe_intermediate_size=30, num_key_value_heads=4))
    if field is None:
        validate_layout(spec, tp, 1, ep)
        with pytest.raises(UnsupportedModelError, match="needs a mixture-of-experts model"):
            validate_layout(spec_from_hf(tiny_config("qwen3")), 1, 1, 2)
        return
    with pytest.raises(UnsupportedModelError, match=field):
        validate_layout(spec, tp, 1, ep)


def test_expert_parallel_rules_and_names():
    """EP rank 1 of 2 holds experts 2 and 3 as local_experts 0 and 1; the HF view (ep_size 1) lists every
    tensor of the checkpoint, each with the shape the config implies."""
    from megatron_dapo.actor.hf_mapping import expected_hf_shape, hf_names, stage_rules
    from megatron_dapo.actor.model import spec_from_hf
    from megatron_dapo.hf_files import SafetensorsReader
    from megatron_dapo.tiny import save_tiny_model, tiny_config

    spec = spec_from_hf(tiny_config("qwen2_moe"))
    mine = {r.megatron_name: r.hf_names for r in stage_rules(spec, ep_rank=1, ep_size=2) if r.expert is not None}
    assert mine["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"] == (
        "model.layers.1.mlp.experts.2.gate_proj.weight", "model.layers.1.mlp.experts.2.up_proj.weight")
    assert len(mine) == 2 * 2 * 2
    assert all(".experts.2." in h[0] or ".experts.3." in h[0] for h in mine.values())
    assert [r.megatron_name for r in stage_rules(spec, te=True) if "norm" in r.megatron_name][:2] == [
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", "decoder.layers.0.pre_mlp_layernorm.weight"]
    for family in ("qwen3", "qwen3_moe", "qwen2_moe"):
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            reader = SafetensorsReader(save_tiny_model(Path(d), family, head_dim=24, tied=True))
            spec = spec_from_hf(tiny_config(family, head_dim=24, tied=True))
            assert sorted(hf_names(spec)) == sorted(reader.weight_map), family
            for name in reader.weight_map:
                assert tuple(reader.get(name).shape) == expected_hf_shape(name, spec), name


def test_checkpoint_views_alias_the_fused_experts():
    """transformers keeps experts fused; writing a per-expert checkpoint tensor through its view changes
    exactly that expert's slice of the model."""
    from megatron_dapo.rollout.embedded.checkpoint_names import checkpoint_views

    model = tiny_model("qwen3_moe")
    views = checkpoint_views(dict(model.named_parameters()))
    experts = model.model.layers[1].mlp.experts
    with torch.no_grad():
        views["model.layers.1.mlp.experts.3.up_proj.weight"].fill_(7.0)
        views["model.layers.1.mlp.experts.2.down_proj.weight"].fill_(5.0)
    assert (experts.gate_up_proj[3, 32:] == 7).all() and not (experts.gate_up_proj[3, :32] == 7).any()
    assert (experts.down_proj[2] == 5).all() and not (experts.down_proj[1] == 5).any()
    assert "model.layers.1.mlp.experts.gate_up_proj" not in views and "model.norm.weight" in views


def _plan(model: str, *overrides: str, nodes: int = 1, gpus: int = 8, mem: float = 141.0):
    from megatron_dapo import plan as P
    from megatron_dapo.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "examples/configs/dapo_qwen2.5_32b.yaml",
                      [f"model.hf_dir=models/{model}", *overrides])
    spec, source = P.resolve_model(cfg)
    return P.make_plan(cfg, spec, P.Hardware(nodes=nodes, gpus_per_node=gpus, gpu_mem_gib=mem), model_source=source)


def test_planner_counts_qwen3_parameters_by_hand():
    """Qwen3-8B and Qwen3-30B-A3B from their public config.json (the built-in table): the model cards' 8.2 B,
    and 30.5 B total / 3.3 B activated."""
    h, v = 4096, 151936  # Qwen3-8B: 36 layers, 32 x 128 query, 8 x 128 KV, FFN 12288, q/k norms
    layer = h * 4096 + 2 * h * 1024 + 4096 * h + 3 * h * 12288 + 2 * h + 2 * 128
    dense = _plan("Qwen3-8B", "parallel.sequence_parallel=false").model
    assert dense.params == 36 * layer + 2 * v * h + h == 8_190_735_360 and dense.activated_params == dense.params
    h = 2048  # Qwen3-30B-A3B: 48 layers, 32 x 128 query, 4 x 128 KV, 128 experts x FFN 768, top-8
    attn = h * 4096 + 2 * h * 512 + 4096 * h + 2 * h + 2 * 128 + 128 * h  # + norms, q/k norms, router
    experts = 128 * 3 * h * 768
    moe = _plan("Qwen3-30B-A3B", "parallel.tensor_parallel=1", "parallel.sequence_parallel=false",
                "parallel.expert_parallel=8").model
    assert moe.params == 48 * (attn + experts) + 2 * v * h + h == 30_532_122_624
    assert moe.activated_params == moe.params - 48 * experts * 120 // 128 == 3_353_032_704
    assert (moe.experts, moe.experts_per_token, moe.ffn) == (128, 8, 768)


def test_planner_splits_experts_over_ep():
    """EP=8 on one node: each GPU holds 16 experts of every layer and the whole rest (TP=1); the distributed
    optimizer shards dense state over DP=8 and expert state over DP / EP = 1 (so its bytes per GPU are those
    of EP=1, where every GPU holds every expert and shards all state over DP=8)."""
    h, v = 2048, 151936
    dense_per_gpu = 48 * (h * 4096 + 2 * h * 512 + 4096 * h + 2 * h + 2 * 128 + 128 * h) + 2 * v * h + h
    experts_per_gpu = 48 * 16 * 3 * h * 768
    # sglang TP=2: at TP=1 the engine's 57 GiB of weights beside the actor's whole state overflow the sync phase
    p = _plan("Qwen3-30B-A3B", "parallel.tensor_parallel=1", "parallel.sequence_parallel=false",
              "parallel.expert_parallel=8", "rollout.sglang.tensor_parallel=2")
    worst = p.train.worst
    assert p.layout.ep == 8 and p.layout.dp == 8
    assert worst.params == dense_per_gpu + experts_per_gpu
    assert worst.optimizer == pytest.approx(12 * (dense_per_gpu / 8 + experts_per_gpu))
    assert p.fits, p.problems
    p1 = _plan("Qwen3-30B-A3B", "parallel.tensor_parallel=1", "parallel.sequence_parallel=false",
               "rollout.sglang.tensor_parallel=2")
    assert p1.train.worst.params == dense_per_gpu + 8 * experts_per_gpu
    assert p1.train.worst.optimizer == pytest.approx(worst.optimizer)
    assert p1.train.worst.weights == 2 * (dense_per_gpu + 8 * experts_per_gpu)
    assert not p1.fits and any("train phase needs" in m for m in p1.problems)


@pytest.mark.parametrize("overrides, reason", [
    (["parallel.expert_parallel=3", "parallel.tensor_parallel=1", "parallel.sequence_parallel=false"],
     "expert_parallel=3 must divide DP=8"),
    (["parallel.tensor_parallel=2", "parallel.sequence_parallel=false"], "only with parallel.sequence_parallel"),
    (["parallel.tensor_parallel=1", "parallel.sequence_parallel=false", "parallel.pipeline_parallel=8",
      "parallel.expert_parallel=1"], None),
])
def test_planner_refuses_expert_layouts_that_cannot_work(overrides, reason):
    p = _plan("Qwen3-30B-A3B", *overrides, "rollout.sglang.tensor_parallel=2")
    if reason is None:
        assert p.fits, p.problems
    else:
        assert any(reason in m for m in p.problems), p.problems


def test_planner_report_names_experts(capsys):
    from megatron_dapo.plan.report import format_plan

    text = format_plan(_plan("Qwen3-30B-A3B", "parallel.tensor_parallel=1", "parallel.sequence_parallel=false",
                             "parallel.expert_parallel=8", "rollout.sglang.tensor_parallel=1"))
    assert "MoE: 128 experts of FFN 768, top-8 per token: 3.35 B params activated per token" in text
    assert "TP=1 x PP=1 x DP=8 = 8 (experts: EP=8 of the DP ranks)" in text
