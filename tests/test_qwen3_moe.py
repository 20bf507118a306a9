"""Qwen3 (QK-norm, head_dim != hidden / heads) and the mixture-of-experts Qwen3-MoE and Qwen2-MoE (shared
expert with a sigmoid gate, norm_topk_prob off) on tiny random models from megatron_dapo.tiny.

Independent references: transformers (fp32 logits, autograd gradients of the DAPO loss written out here)
and the HF checkpoint itself (bit-identical export). Layouts run tests/workers/moe_worker.py under torchrun
(gloo): TP1, TP2, EP2 (the all-to-all token dispatcher across 2 ranks) and PP2. The routers are scaled so
that every token's top-k is decided by a wide margin (checked below), so fp32 noise between layouts
cannot flip an expert choice.
"""

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support import launch_plan
from workers.actor_worker import GRAD_CLIP, LR, VOCAB, fixed_batch, old_logprob_offset

from megatron_dapo.parallel import free_port
from megatron_dapo.tiny import tiny_model

WORKER = Path(__file__).parent / "workers" / "moe_worker.py"
SYNC_WORKER = Path(__file__).parent / "workers" / "sync_worker.py"
SMALL = {"vocab_size": VOCAB, "max_position_embeddings": 128, "eos_token_id": VOCAB - 1}
MODELS: dict[str, tuple[str, bool, dict[str, Any]]] = {  # name: (family, tied, overrides)
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


def run_worker(case, dirs, out, tp, pp, ep, ranks, env, timeout=500):
    """One run of the worker: its results by rank."""
    entry = {"case": case, "hf_dirs": [str(d) for d in dirs], "out": out, "tp": tp, "pp": pp, "ep": ep}
    return launch_plan(WORKER, ranks, [entry], env, timeout)[0]


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
    root, runs = tmp_path_factory.mktemp("logits"), dict[str, list[dict]]()
    for nproc in (1, 2):  # one launch per world size
        names = [name for name, spec in LOGIT_LAYOUTS.items() if spec[3] == nproc]
        entries = [{"case": "logits", "hf_dirs": [str(hf_dirs[m]) for m in LOGIT_LAYOUTS[name][4]],
                    "out": root / name, "tp": LOGIT_LAYOUTS[name][0], "pp": LOGIT_LAYOUTS[name][1],
                    "ep": LOGIT_LAYOUTS[name][2]} for name in names]
        runs.update(zip(names, launch_plan(WORKER, nproc, entries, env)))
    return runs


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


def test_ep_ranks_that_pack_different_micro_batch_counts_agree(hf_dirs, tmp_path, env):
    """EP2 ranks whose rows pack into 4 and 2 micro-batches (a rank with more would wait in an all-to-all that
    nobody joins: a hang before the ranks agreed on the count): the short rank runs fillers, and each rank's
    pi_old logprobs and the update's loss and gradients equal EP1's on the same rows."""
    dirs = [hf_dirs["qwen3_moe"]]
    ref = run_worker("uneven", dirs, tmp_path / "ep1", 1, 1, 1, 1, env)[0]["models"]["qwen3_moe"]
    runs = run_worker("uneven", dirs, tmp_path / "ep2", 1, 1, 2, 2, env, timeout=300)
    assert [r["models"]["qwen3_moe"]["packed"] for r in runs] == [4, 2]
    for r in runs:
        res, rows = r["models"]["qwen3_moe"], slice(4 * r["ep_rank"], 4 * r["ep_rank"] + 4)
        assert torch.allclose(res["logprobs"], ref["logprobs"][rows], atol=1e-5)
        for key in ("loss", "tokens", "grad_norm", "clipfrac_high", "clipfrac_low"):
            assert res["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-7), key
    grads = _merged(runs, "qwen3_moe", "grads")
    assert grads.keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        assert torch.allclose(grads[name], g, atol=2e-6, rtol=1e-4), name


@pytest.mark.parametrize("model", ["qwen3", *MOE])
def test_loss_and_clipped_grads_equal_plain_torch(train_runs, hf_dirs, model):
    """transformers forward + the DAPO loss written out here, autograd: Megatron adds nothing to the loss (no
    MoE load-balancing or z-loss gradient), the grad norm covers every expert, the clip is Megatron's."""
    from megatron_dapo.rollout.embedded.checkpoint_names import checkpoint_views

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


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen3_moe", "qwen2_moe", "qwen3_tied"])
def test_conversion_round_trip_is_bit_identical(converted, hf_dirs, model):
    _assert_same_hf(hf_dirs[model], converted / f"{model}_hf")


@pytest.mark.slow
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
