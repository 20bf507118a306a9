"""The Megatron actor on CPU: parity with transformers and across TP / PP / DP layouts, the token-level
update, checkpoints. Multi-rank cases run tests/workers/actor_worker.py under torchrun (gloo)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).parent / "workers" / "actor_worker.py"
sys.path.insert(0, str(WORKER.parent))
from actor_worker import VOCAB, fixed_batch  # noqa: E402


def run_layout(case, hf_dir, out_dir, tp=1, pp=1, nproc=1, ckpt=None, env=None, timeout=240):
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(_free_port()), str(WORKER), case, str(hf_dir), str(out_dir), str(tp), str(pp)]
    if ckpt is not None:
        cmd.append(str(ckpt))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return [torch.load(out_dir / f"rank_{i}.pt", weights_only=False) for i in range(nproc)]


def _free_port():
    from megatron_dapo.parallel import free_port

    return free_port()


def merged(results, key):
    """Union of per-rank dicts of HF-named tensors (PP stages hold different layers)."""
    out = {}
    for r in results:
        out.update(r[key])
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    d = tmp_path_factory.mktemp("hf")
    Qwen2ForCausalLM(cfg).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def reference(hf_dir):
    """Teacher-forced logprobs and entropy from transformers + plain torch (the independent oracle)."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    b = fixed_batch()
    with torch.no_grad():
        logits = model(b.input_ids).logits[:, :-1].double()
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, b.input_ids[:, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    valid = torch.arange(b.input_ids.shape[1])[None, 1:] < b.lengths[:, None]
    return {"logprobs": lp, "entropy": ent, "valid": valid}


@pytest.fixture(scope="module")
def layouts(hf_dir, tmp_path_factory, python_env_module):
    root = tmp_path_factory.mktemp("layouts")
    return {
        "tp1": run_layout("train", hf_dir, root / "tp1", ckpt=root / "ckpt_tp1", env=python_env_module),
        "tp2": run_layout("train", hf_dir, root / "tp2", tp=2, nproc=2, ckpt=root / "ckpt_tp2", env=python_env_module),
        "pp2": run_layout("train", hf_dir, root / "pp2", pp=2, nproc=2, env=python_env_module),
        "dp2": run_layout("train", hf_dir, root / "dp2", nproc=2, env=python_env_module),
        "dp2_distopt": run_layout("train", hf_dir, root / "dp2_distopt", nproc=2,
                                  env={**python_env_module, "DAPO_TEST_DISTOPT": "1"}),
        "root": root,
    }


@pytest.fixture(scope="module")
def python_env_module():
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{Path(__file__).resolve().parents[1]}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["OMP_NUM_THREADS"] = "1"
    return env


def _shifted(t):
    return t[:, 1:]


@pytest.mark.parametrize("layout", ["tp1", "tp2", "pp2", "dp2"])
def test_logprobs_and_entropy_match_transformers(layouts, reference, layout):
    valid = reference["valid"]
    for r in layouts[layout]:
        lp, ent = _shifted(r["logprobs"]).double(), _shifted(r["entropy"]).double()
        assert (lp[valid] - reference["logprobs"][valid]).abs().max() < 1e-5
        assert (ent[valid] - reference["entropy"][valid]).abs().max() < 1e-5
        assert (lp[valid] <= 0).all()


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2", "dp2_distopt"])
def test_update_is_layout_invariant(layouts, layout):
    """Same loss, same gradient, same parameters after the update as TP1/PP1/DP1 on the whole batch.

    dp2: each rank holds half the rows (packed into several micro-batches) and the token-level loss
    is normalised by the global token count, so the summed gradient equals the full-batch one.
    """
    ref = layouts["tp1"][0]
    grads, params = merged(layouts[layout], "grads"), merged(layouts[layout], "params")
    assert grads.keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        if layout != "dp2_distopt":  # the distributed optimizer reduce-scatters: each rank holds a shard
            assert torch.allclose(grads[name], g, atol=2e-6, rtol=1e-4), name
        # Adam's first step is ~lr * g / (|g| + eps): grads of ~1e-8 amplify fp32 noise, so compare at 1% of lr
        assert torch.allclose(params[name], ref["params"][name], atol=1e-4), name
    metrics = layouts[layout][-1]["metrics"]
    for key in ("loss", "tokens", "clipfrac_high", "clipfrac_low", "entropy"):
        assert metrics[key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-7), key


def test_loss_and_grads_equal_plain_torch(layouts, hf_dir):
    """Independent oracle: transformers forward + the DAPO loss written out here, autograd grads."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    b = fixed_batch()
    logits = model(b.input_ids).logits[:, :-1]
    lp = torch.log_softmax(logits, -1).gather(-1, b.input_ids[:, 1:, None]).squeeze(-1)
    old = lp.detach() + 0.3 * torch.sin(torch.arange(b.input_ids.numel()).view_as(b.input_ids) * 1.7)[:, 1:]
    ratio, adv, mask = torch.exp(lp - old), b.advantages[:, None], b.loss_mask[:, 1:]
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - 0.2, 1 + 0.28) * adv)
    loss = -(surrogate * mask).sum() / mask.sum()
    loss.backward()
    ref = layouts["tp1"][0]
    assert ref["metrics"]["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert ref["metrics"]["tokens"] == mask.sum().item()
    assert 0 < ref["metrics"]["clipfrac_high"] < 1 and 0 < ref["metrics"]["clipfrac_low"] < 1
    for name, p in model.named_parameters():
        assert torch.allclose(ref["grads"][name], p.grad, atol=1e-6, rtol=1e-4), name


def test_token_level_exactness_dp2_split(layouts):
    """Each DP rank reported its own share; the sum over ranks is the full-batch loss."""
    assert layouts["dp2"][0]["metrics"]["loss"] == pytest.approx(layouts["tp1"][0]["metrics"]["loss"], rel=1e-6)


def test_checkpoint_exact_continuation(hf_dir, layouts, python_env_module):
    res = run_layout("load", hf_dir, layouts["root"] / "load_tp1", ckpt=layouts["root"] / "ckpt_tp1",
                     env=python_env_module)
    assert res[0]["next_losses"] == layouts["tp1"][0]["next_losses"]
    assert torch.equal(res[0]["logprobs"], layouts["tp1"][0]["logprobs_after"])


def test_checkpoint_reshard_tp2_to_tp1(hf_dir, layouts, python_env_module):
    res = run_layout("load", hf_dir, layouts["root"] / "load_tp2_as_tp1", ckpt=layouts["root"] / "ckpt_tp2",
                     env=python_env_module)
    saved = layouts["tp2"][0]
    valid = fixed_batch().lengths[:, None] > torch.arange(16)[None]
    assert (res[0]["logprobs"] - saved["logprobs_after"])[valid].abs().max() < 1e-5
    assert res[0]["next_losses"] == pytest.approx(saved["next_losses"], rel=1e-4)


def test_train_step_lowers_the_loss(hf_dir, tmp_path, python_env_module):
    losses = run_layout("learn", hf_dir, tmp_path, env=python_env_module)[0]["losses"]
    assert losses[-1] < losses[0] - 0.05, losses


def test_checkpoints_are_atomic_and_pruned(layouts):
    from megatron_dapo.actor.checkpoint import latest_checkpoint

    root = layouts["root"] / "ckpt_tp1"
    assert latest_checkpoint(root).name == "step_00000001"
    (root / "step_00000002").mkdir()  # a crash mid-save leaves no COMPLETE marker
    assert latest_checkpoint(root).name == "step_00000001"
    assert latest_checkpoint(layouts["root"] / "missing") is None


def test_nonfinite_loss_skips_the_update(hf_dir, tmp_path, python_env_module):
    res = run_layout("nan", hf_dir, tmp_path, env=python_env_module)[0]
    assert res["metrics"]["nonfinite"] == 1.0 and res["metrics"]["update_ok"] == 0.0
    assert res["unchanged"]
    assert res["metrics_next"]["update_ok"] == 1.0  # the next healthy step trains normally
