"""Qwen3 (QK-norm, head_dim != hidden / heads) and the mixture-of-experts Qwen3-MoE and Qwen2-MoE (shared
expert with a sigmoid gate, norm_topk_prob off) on tiny random models from megatron_dapo.tiny.

Independent references: transformers (fp32 logits, autograd gradients of the DAPO loss written out here)
and the HF checkpoint itself (bit-identical export). Layouts run tests/workers/moe_worker.py under torchrun
(gloo): TP1, TP2, EP2 (the all-to-all token dispatcher across 2 ranks) and PP2. The routers are scaled so
that every token's top-k is decided by a wide margin (checked below), so fp32 noise between layouts
cannot flip an expert choice.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from workers.actor_worker import GRAD_CLIP, LR, VOCAB, fixed_batch, old_logprob_offset

from megatron_dapo.parallel import free_port
from megatron_dapo.tiny import tiny_model

WORKER = Path(__file__).parent / "workers" / "moe_worker.py"
SYNC_WORKER = Path(__file__).parent / "workers" / "sync_worker.py"
SMALL = {"vocab_size": VOCAB, "max_position_embeddings": 128, "eos_token_id": VOCAB - 1}
MODELS = {  # name: (family, tied, overrides)
    "qwen3": ("qwen3", False, {"head_dim": 24}),
    "qwen3_tied": ("qwen3", True, {"head_dim": 24}),
    "qwen3_moe": ("qwen3_moe", False, {"head_dim": 24}),
    "qwen2_moe": ("qwen2_moe", True, {"norm_topk_prob": False}),
}
MOE = ["qwen3_moe", "qwen2_moe"]
LOGIT_LAYOUTS = {  # name: (tp, pp, ep, ranks, models)
    "tp1": (1, 1, 1, 1, list(MODELS)),
    "tp2": (2, 1, 1, 2, list(MODELS)),
    "ep2": (1, 1, 2, 2, MOE),
    "pp2": (1, 2, 1, 2, list(MODELS)),
}
ROUTER_SCALE = 8.0
"""Router logits of a few units: top-k choices far apart, yet no softmax saturation (equal tiny probabilities)."""


def _save(name: str, folder: Path) -> Path:
    family, tied, overrides = MODELS[name]
    model = tiny_model(family, seed=3, tied=tied, **SMALL, **overrides)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:  # away from 1, so a swapped or dropped norm (q_norm vs k_norm) shows
                p.uniform_(0.5, 1.5)
            if pname.endswith("mlp.gate.weight"):
                p.mul_(ROUTER_SCALE)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_models")
    return {name: _save(name, root / name) for name in MODELS}


@pytest.fixture(scope="module")
def env():
    e = dict(os.environ)
    e["PYTHONPATH"] = f"{Path(__file__).resolve().parents[1]}{os.pathsep}{e.get('PYTHONPATH', '')}"
    e["OMP_NUM_THREADS"] = "1"
    return e


def run_worker(case, dirs, out, tp, pp, ep, ranks, env, timeout=500):
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
           str(free_port()), str(WORKER), case, ",".join(map(str, dirs)), str(out), str(tp), str(pp), str(ep)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return [torch.load(out / f"rank_{i}.pt", weights_only=False) for i in range(ranks)]


def _hf(hf_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()


def test_every_top_k_choice_is_unambiguous(hf_dirs):
    """The precondition of the layout comparisons: on the tokens they use, the k-th and (k+1)-th router
    logits and probabilities of every token are far apart (vs fp32 noise ~1e-6) in every layer."""
    from megatron_dapo.actor.convert_verify import verify_tokens
    from megatron_dapo.actor.model import load_hf_config, spec_from_hf

    for name in MOE:
        model, gaps = _hf(hf_dirs[name]), []
        k = model.config.num_experts_per_tok

        def hook(_module, _inp, out):
            for scores, margin in ((out[0].float(), 1e-3), (torch.softmax(out[0].float(), -1), 1e-4)):
                top = scores.topk(k + 1, dim=-1).values
                gaps.append((top[:, k - 1] - top[:, k]).min().item() / margin)

        for layer in model.model.layers:
            layer.mlp.gate.register_forward_hook(hook)
        with torch.no_grad():
            model(verify_tokens(spec_from_hf(load_hf_config(hf_dirs[name]))))
            model(fixed_batch().input_ids)
        assert len(gaps) == 8 and min(gaps) > 1, (name, gaps)


@pytest.fixture(scope="module")
def logits_runs(hf_dirs, tmp_path_factory, env):
    root = tmp_path_factory.mktemp("logits")
    return {name: run_worker("logits", [hf_dirs[m] for m in models], root / name, tp, pp, ep, ranks, env)
            for name, (tp, pp, ep, ranks, models) in LOGIT_LAYOUTS.items()}


@pytest.mark.parametrize(("layout", "model"),
                         [(layout, m) for layout, spec in LOGIT_LAYOUTS.items() for m in spec[4]])
def test_logits_match_transformers_and_export_is_bit_identical(logits_runs, hf_dirs, layout, model):
    from megatron_dapo.actor.convert_verify import compare_logits, hf_logits, verify_tokens
    from megatron_dapo.actor.model import load_hf_config, spec_from_hf
    from megatron_dapo.hf_files import SafetensorsReader

    spec = spec_from_hf(load_hf_config(hf_dirs[model]))
    ref = hf_logits(hf_dirs[model], verify_tokens(spec))
    names = set(SafetensorsReader(hf_dirs[model]).weight_map)
    for rank in logits_runs[layout]:
        res = rank["models"][model]
        if res["last_stage"]:
            diff, agree = compare_logits(res["logits"], ref)
            assert diff <= 1e-4 and agree == 1.0, (layout, model, diff)
        if LOGIT_LAYOUTS[layout][1] == 1:  # every rank of a stage exports the whole stage, experts included
            assert set(res["identical"]) == names, sorted(names ^ set(res["identical"]))
        assert all(res["identical"].values()), [n for n, ok in res["identical"].items() if not ok]
    if LOGIT_LAYOUTS[layout][1] == 2:  # the two stages together export every tensor
        assert set().union(*(r["models"][model]["identical"] for r in logits_runs[layout])) == names


# --- the DAPO update: EP2 equals EP1, and both equal plain torch -----------------------------------------


@pytest.fixture(scope="module")
def train_runs(hf_dirs, tmp_path_factory, env):
    root = tmp_path_factory.mktemp("train")
    return {"ep1": run_worker("train", [hf_dirs[m] for m in ["qwen3", *MOE]], root / "ep1", 1, 1, 1, 1, env)[0],
            "ep2": run_worker("train", [hf_dirs[m] for m in MOE], root / "ep2", 1, 1, 2, 2, env)}


def _merged(ranks, model, key):
    out = {}
    for r in ranks:
        out.update(r["models"][model][key])
    return out


@pytest.mark.parametrize("model", MOE)
def test_ep2_update_equals_ep1(train_runs, model):
    """EP2 (2 ranks: data-parallel rows, experts split, tokens exchanged all-to-all) reports the same loss
    and grad norm, and ends with the same gradients and parameters after every clipped update."""
    ref, runs = train_runs["ep1"]["models"][model], train_runs["ep2"]
    norms = [m["grad_norm"] for m in ref["history"]]
    assert all(GRAD_CLIP / (n + 1e-6) < 0.9 for n in norms), norms  # clipping acts in every update
    for r in runs:
        got = [m["grad_norm"] for m in r["models"][model]["history"]]
        assert got == pytest.approx(norms, rel=1e-5), (got, norms)
    grads, params, final = (_merged(runs, model, k) for k in ("grads", "params", "params_final"))
    assert grads.keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        assert torch.allclose(grads[name], g, atol=2e-6, rtol=1e-4), name
        assert torch.allclose(params[name], ref["params"][name], atol=LR / 100), name
        assert torch.allclose(final[name], ref["params_final"][name], atol=LR / 20), name
    metrics = runs[-1]["models"][model]["metrics"]
    for key in ("loss", "tokens", "clipfrac_high", "clipfrac_low", "entropy"):
        assert metrics[key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("model", ["qwen3", *MOE])
def test_loss_and_clipped_grads_equal_plain_torch(train_runs, hf_dirs, model):
    """transformers forward + the DAPO loss written out here, autograd: Megatron adds nothing to the loss (no
    MoE load-balancing or z-loss gradient), the grad norm covers every expert, the clip is Megatron's."""
    from megatron_dapo.rollout.checkpoint_names import checkpoint_views

    hf = _hf(hf_dirs[model])
    b = fixed_batch()
    lp = torch.log_softmax(hf(b.input_ids).logits[:, :-1], -1).gather(-1, b.input_ids[:, 1:, None]).squeeze(-1)
    old = lp.detach() + old_logprob_offset(b)[:, 1:]
    ratio, adv, mask = torch.exp(lp - old), b.advantages[:, None], b.loss_mask[:, 1:]
    loss = -(torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.28) * adv) * mask).sum() / mask.sum()
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in hf.parameters())).item()
    ref = train_runs["ep1"]["models"][model]
    assert ref["metrics"]["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert ref["metrics"]["grad_norm"] == pytest.approx(norm, rel=1e-5)
    coef = min(1.0, GRAD_CLIP / (norm + 1e-6))
    hf_grads = checkpoint_views({n: p.grad for n, p in hf.named_parameters()})
    assert coef < 1.0 and hf_grads.keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        assert torch.allclose(g, coef * hf_grads[name], atol=1e-6, rtol=1e-4), name


# --- weight sync into the embedded engine ------------------------------------------------------------


@pytest.mark.parametrize(("model", "tp", "ep"), [("qwen3_tied", 2, 1), ("qwen3_moe", 1, 2), ("qwen2_moe", 1, 1)])
def test_weight_sync_gives_the_engine_the_actors_logprobs(hf_dirs, tmp_path, env, model, tp, ep):
    """After one update and a sync (HF names; experts gathered from their EP ranks), the embedded engine's
    logprobs of its own samples are the actor's; before the sync they were not."""
    out = tmp_path / "sync.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(tp * ep), "--master_port",
           str(free_port()), str(SYNC_WORKER), str(hf_dirs[model]), str(out), str(tp), "1", str(ep)]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**env, "PYTHONPATH": f"{SYNC_WORKER.parent}:"
                                                                 f"{env['PYTHONPATH']}"}, timeout=400)
    assert r.returncode == 0, r.stderr[-5000:]
    res = torch.load(out)
    assert res["mean_abs_diff"] < 1e-5 and res["max_abs_diff"] < 1e-4, res
    assert res["stale_mean_abs_diff"] > 1e-3, res
    from megatron_dapo.hf_files import SafetensorsReader

    assert res["tensors"] == len(SafetensorsReader(hf_dirs[model]).weight_map)


# --- the conversion tools --------------------------------------------------------------------------


TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _tool(script: str, *args, env) -> str:
    r = subprocess.run([sys.executable, str(TOOLS / script), *map(str, args), "--verify", "--quiet"],
                       capture_output=True, text=True, env=env, timeout=400)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout[-2000:] + r.stderr[-4000:]
    assert re.search(r"max \|logit diff\| = [0-9.e+-]+ .*: OK", r.stdout), r.stdout
    return r.stdout


def _assert_same_hf(src: Path, out: Path) -> None:
    from megatron_dapo.hf_files import SafetensorsReader

    a, b = SafetensorsReader(src), SafetensorsReader(out)
    assert set(a.weight_map) == set(b.weight_map)
    for name in a.weight_map:
        x, y = a.get(name), b.get(name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()


@pytest.fixture(scope="module")
def converted(hf_dirs, tmp_path_factory, env):
    """HF -> Megatron with convert_hf_to_megatron --verify (MoE at TP2, dense Qwen3 at PP2: the tool spawns
    2 ranks and compares the reloaded checkpoint's logits with transformers'), then back with
    convert_megatron_to_hf --verify (read at TP1)."""
    root = tmp_path_factory.mktemp("converted")
    layouts = {"qwen3_moe": ("--tp", 2), "qwen2_moe": ("--pp", 2), "qwen3_tied": ("--pp", 2)}
    for name, layout in layouts.items():
        _tool("convert_hf_to_megatron.py", "--hf-dir", hf_dirs[name], "--save", root / name, *layout, env=env)
        _tool("convert_megatron_to_hf.py", "--load", root / name, "--save", root / f"{name}_hf", env=env)
    return root


@pytest.mark.parametrize("model", ["qwen3_moe", "qwen2_moe", "qwen3_tied"])
def test_conversion_round_trip_is_bit_identical(converted, hf_dirs, model):
    _assert_same_hf(hf_dirs[model], converted / f"{model}_hf")


def test_actor_loads_converted_moe_checkpoints_at_ep2(converted, hf_dirs, tmp_path, env):
    """Written at TP2 / PP2, read by the actor at EP2 (dist checkpointing reshards the stacked experts),
    then exported with save_hf_checkpoint (experts gathered from both EP ranks): same logits, same tensors."""
    from megatron_dapo.actor.convert_verify import compare_logits, hf_logits, verify_tokens
    from megatron_dapo.actor.model import load_hf_config, spec_from_hf

    ranks = run_worker("checkpoint", [converted / m for m in MOE], tmp_path, 1, 1, 2, 2, env)
    for model in MOE:
        ref = hf_logits(hf_dirs[model], verify_tokens(spec_from_hf(load_hf_config(hf_dirs[model]))))
        for r in ranks:
            diff, agree = compare_logits(r["models"][model]["logits"], ref)
            assert diff <= 1e-4 and agree == 1.0, (model, diff)
        _assert_same_hf(hf_dirs[model], tmp_path / f"{model}_export")


# --- config, layout and planner: no process group ------------------------------------------------------


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
    from megatron_dapo.rollout.checkpoint_names import checkpoint_views

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
    p = _plan("Qwen3-30B-A3B", "parallel.tensor_parallel=1", "parallel.sequence_parallel=false",
              "parallel.expert_parallel=8", "rollout.sglang.tensor_parallel=1")
    worst = p.train.worst
    assert p.layout.ep == 8 and p.layout.dp == 8
    assert worst.params == dense_per_gpu + experts_per_gpu
    assert worst.optimizer == pytest.approx(12 * (dense_per_gpu / 8 + experts_per_gpu))
    assert p.fits, p.problems
    p1 = _plan("Qwen3-30B-A3B", "parallel.tensor_parallel=1", "parallel.sequence_parallel=false",
               "rollout.sglang.tensor_parallel=1")
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
    p = _plan("Qwen3-30B-A3B", *overrides, "rollout.sglang.tensor_parallel=1")
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
