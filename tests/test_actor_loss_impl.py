"""actor.loss_impl = logits | linear against an independent oracle (transformers in float64 + the DAPO
loss written out here, autograd gradients), at TP1 and TP2, untied and tied output weights, with and
without a sampling temperature; and one update with each other policy loss (GSPO, CISPO, Dr. GRPO)
against its paper's equation written out here.
Megatron pads the vocab to 256: at TP2 the second rank's shard is part
padding (vocab 200) or padding only (vocab 100). Runs tests/workers/loss_impl_worker.py under torchrun (gloo)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from workers.loss_impl_worker import CASES, MAX_RESPONSE_LEN, fixed_batch

from megatron_dapo.parallel import free_port

WORKER = Path(__file__).parent / "workers" / "loss_impl_worker.py"


@pytest.fixture(scope="module", params=[(False, 200), (True, 200), (True, 100)],
                ids=["untied", "tied", "tied-v100"])
def model_dir(request, tmp_path_factory):
    from megatron_dapo.tiny import save_tiny_model

    tied, vocab = request.param
    return save_tiny_model(tmp_path_factory.mktemp("m"), "qwen2", seed=5, tied=tied, vocab_size=vocab,
                           max_position_embeddings=64)


def _vocab(model_dir: Path) -> int:
    import json

    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def run(model_dir: Path, out: Path, tp: int, env: dict, *extra: str) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(tp), "--master_port",
           str(free_port()), str(WORKER), str(model_dir), str(out), str(tp), str(_vocab(model_dir)), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return [torch.load(out / f"rank_{i}.pt", weights_only=False) for i in range(tp)]


def oracle(model_dir: Path, temperature: float) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float64)
    b = fixed_batch(_vocab(model_dir))
    logp = torch.log_softmax(model(b.input_ids).logits[:, :-1] / temperature, -1)
    lp = logp.gather(-1, b.input_ids[:, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    old = lp.detach() + b.old_logprobs[:, 1:].double()
    ratio, adv, mask = torch.exp(lp - old), b.advantages[:, None].double(), b.loss_mask[:, 1:].double()
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - 0.2, 1 + 0.28) * adv)
    loss = -(surrogate * mask).sum() / mask.sum()
    loss.backward()
    valid = torch.arange(b.input_ids.shape[1])[None, 1:] < b.lengths[:, None]
    return {"logprobs": lp.detach(), "entropy": ent.detach(), "loss": loss.item(), "valid": valid,
            "grads": {n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.slow), 2])  # TP2 splits the vocabulary too
def test_loss_impls_match_the_oracle(model_dir, tmp_path, python_env, tp):
    ranks = run(model_dir, tmp_path, tp, python_env)
    for impl, temperature in CASES:
        ref = oracle(model_dir, temperature)
        valid = ref["valid"]
        for rank in ranks:
            got = rank[f"{impl}@{temperature}"]
            assert got["impl"] == impl
            lp, ent = got["logprobs"][:, 1:].double(), got["entropy"][:, 1:].double()
            assert (lp - ref["logprobs"])[valid].abs().max() < 2e-5, (impl, temperature)
            assert (ent - ref["entropy"])[valid].abs().max() < 2e-5, (impl, temperature)
            assert got["metrics"]["loss"] == pytest.approx(ref["loss"], rel=1e-5), (impl, temperature)
            assert got["grads"].keys() == ref["grads"].keys()
            for name, g in ref["grads"].items():
                torch.testing.assert_close(got["grads"][name].double(), g, atol=2e-6, rtol=1e-4,
                                           msg=lambda m: f"{impl}@{temperature} {name}: {m}")


def variant_oracle(model_dir: Path, kind: str) -> dict:
    """Each variant's loss from its paper's equation on transformers' float64 logprobs (the worker's KINDS
    settings), micro-batches and the actor's global normalisers nowhere in sight; autograd gradients."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float64)
    b = fixed_batch(_vocab(model_dir))
    logp = torch.log_softmax(model(b.input_ids).logits[:, :-1], -1)
    lp = logp.gather(-1, b.input_ids[:, 1:, None]).squeeze(-1)
    old = lp.detach() + b.old_logprobs[:, 1:].double()
    adv, mask = b.advantages[:, None].double(), b.loss_mask[:, 1:].double()
    ratio = torch.exp(lp - old)
    seqs = int((mask.sum(-1) > 0).sum())
    if kind == "gspo":  # eq. 5: (1/G) sum_i min(s_i A_i, clip(s_i) A_i), s_i the length-normalised ratio
        s = torch.exp(((lp - old) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True))
        loss = -torch.minimum(s * adv, s.clamp(0.98, 1.02) * adv).sum() / seqs
        clipped = ((adv > 0) & (s > 1.02)) | ((adv < 0) & (s < 0.98))
        assert clipped.any() and not clipped.all(), "the batch must clip some sequences and not others"
    elif kind == "cispo":  # eq. 4: sg[min(r, eps_high)] A log pi, token-mean
        loss = -(ratio.detach().clamp(max=1.2) * adv * lp * mask).sum() / mask.sum()
    else:  # Dr. GRPO eq. 3: PPO's clipped token terms summed, / (G x L_max)
        surrogate = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
        loss = -(surrogate * mask).sum() / (seqs * MAX_RESPONSE_LEN)
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad for n, p in model.named_parameters()}}


def test_the_actor_trains_each_policy_loss(tmp_path, python_env):
    """algo.policy_loss reaches the actor's update (several micro-batches, global normalisers)."""
    from megatron_dapo.tiny import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "m", "qwen2", seed=5, tied=False, vocab_size=200,
                                max_position_embeddings=64)
    (rank,) = run(model_dir, tmp_path / "out", 1, python_env, "--kinds")
    for kind, got in rank.items():
        ref = variant_oracle(model_dir, kind)
        assert got["metrics"]["loss"] == pytest.approx(ref["loss"], rel=1e-5), kind
        for name, g in ref["grads"].items():
            torch.testing.assert_close(got["grads"][name].double(), g, atol=2e-6, rtol=1e-4,
                                       msg=lambda m: f"{kind} {name}: {m}")
