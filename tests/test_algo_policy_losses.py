"""The policy-loss variants (GSPO, CISPO, Dr. GRPO) against references written here from each paper's
equation in plain float64 torch (row by row, the sequence-level form where the paper has one), their
invariance to micro-batch splits (the 2-rank data-parallel split is in test_algo_loss.py), dual-clip,
importance weights, clip fractions, Dr. GRPO's advantages, and the registry (a user's decorated loss)."""

import math
from typing import Any

import pytest
import torch
from support import global_kwargs, random_batch

from megatron_dapo.algo.advantages import group_advantages
from megatron_dapo.algo.loss import policy_loss
from megatron_dapo.algo.policy_losses import (
    REGISTRY,
    PolicyLossLoadError,
    clip_range,
    policy_loss_spec,
    register_policy_loss,
)
from megatron_dapo.config.schema import POLICY_LOSSES

F64 = torch.float64
KINDS = ("dapo", "gspo", "cispo", "dr_grpo")


def rows_of(base, old, adv, mask):
    """Per row: (logprobs, old logprobs, advantage) of its valid tokens only."""
    for i in range(base.shape[0]):
        keep = mask[i] != 0
        yield i, keep, base[i][keep], old[i][keep], float(adv[i])


def gspo_sequence_reference(base, old, adv, mask, eps_low, eps_high):
    """GSPO eq. 5-7 as written: J = (1/G) sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log ratio),
    autograd through s_i itself (the sequence-level gradient, eq. 7). G counts the rows with tokens."""
    lp = base.clone().requires_grad_()
    terms = []
    for i, keep, _, o, a in rows_of(base, old, adv, mask):
        if keep.any():
            s = torch.exp((lp[i][keep] - o).mean())
            terms.append(torch.minimum(s * a, s.clamp(1 - eps_low, 1 + eps_high) * a))
    loss = -torch.stack(terms).sum() / len(terms)
    loss.backward()
    return loss.detach(), lp.grad


def test_gspo_matches_the_sequence_level_objective():
    """Under seq-mean-token-mean the GSPO-token form has GSPO's value and gradient; some sequences must be
    clipped (zero gradient on all their tokens) and some not."""
    base, old, adv, mask = random_batch(10)  # sequence log-ratios within +-0.1
    eps_low, eps_high = 0.03, 0.04
    want, want_grad = gspo_sequence_reference(base, old, adv, mask, eps_low, eps_high)
    lp = base.clone().requires_grad_()
    loss, m = policy_loss(lp, old, adv, mask, eps_low, eps_high, "seq-mean-token-mean", kind="gspo")
    loss.backward()
    torch.testing.assert_close(loss.detach(), want, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lp.grad, want_grad, atol=1e-12, rtol=1e-10)
    row_clipped = (lp.grad.abs().sum(-1) == 0) & (mask.sum(-1) > 0)
    assert row_clipped.any() and (~row_clipped & (mask.sum(-1) > 0)).any(), "data must clip some sequences"
    assert m.clipfrac_high + m.clipfrac_low > 0


def test_gspo_token_mean_gradient_by_hand():
    """GSPO-token (eq. 13-14) under token-mean: every token of sequence i has gradient -s_i A_i / N unless
    its sequence is clipped (A > 0, s > 1 + eps_high or A < 0, s < 1 - eps_low); dual-clip at the sequence
    level; importance weights scale the token terms. Hand arithmetic, row by row."""
    base, old, adv, mask = random_batch(11)
    is_w = torch.rand(base.shape, generator=torch.Generator().manual_seed(3), dtype=F64) + 0.5
    eps_low, eps_high, c = 0.03, 0.03, 1.035
    n = mask.sum()
    want_loss, want_grad = 0.0, torch.zeros_like(base)
    hit = {"high": 0, "low": 0, "dual": 0}
    for i, keep, lp_i, o, a in rows_of(base, old, adv, mask):
        if not keep.any():
            continue
        s = math.exp(float((lp_i - o).mean()))
        w = is_w[i][keep]
        if a < 0 and s > c:
            obj, g, hit["dual"] = c * a, 0.0, hit["dual"] + 1
        elif (a > 0 and s > 1 + eps_high) or (a < 0 and s < 1 - eps_low):
            obj, g = min(1 + eps_high, max(1 - eps_low, s)) * a, 0.0
            hit["high" if a > 0 else "low"] += 1
        else:
            obj, g = s * a, -s * a
        want_loss += float(-(obj * w).sum() / n)
        want_grad[i][keep] = g * w / n
    assert all(hit.values()), hit
    lp = base.clone().requires_grad_()
    loss, _ = policy_loss(lp, old, adv, mask, eps_low, eps_high, kind="gspo", clip_ratio_c=c, is_weights=is_w)
    loss.backward()
    assert loss.item() == pytest.approx(want_loss, rel=1e-10)
    torch.testing.assert_close(lp.grad, want_grad, atol=1e-12, rtol=1e-9)


def test_gspo_defaults_are_the_papers():
    assert clip_range(policy_loss_spec("gspo"), None, None) == (3e-4, 4e-4)
    assert clip_range(policy_loss_spec("dapo"), None, None) == (0.2, 0.28)
    assert clip_range(policy_loss_spec("dr_grpo"), None, None) == (0.2, 0.2)
    assert clip_range(policy_loss_spec("cispo"), None, None) == (0.0, 5.0)


def test_cispo_by_hand():
    """CISPO eq. 4-5: loss = -(1/N) sum sg[min(r, eps_high)] A log pi; d loss / d log pi = -min(r, cap) A / N
    for every token: none is clipped away (unlike PPO's clip), the cap only bounds the weight."""
    base, old, adv, mask = random_batch(12)
    base = old + (base - old) * 3  # ratios spread over [~0.1, ~10]
    cap = 2.0
    is_w = torch.rand(base.shape, generator=torch.Generator().manual_seed(4), dtype=F64)
    n = mask.sum()
    want_loss, want_grad, capped = 0.0, torch.zeros_like(base), 0
    for i, keep, lp_i, o, a in rows_of(base, old, adv, mask):
        for t, (x, y, w) in enumerate(zip(lp_i.tolist(), o.tolist(), is_w[i][keep].tolist())):
            weight = min(math.exp(x - y), cap)
            capped += math.exp(x - y) > cap
            want_loss -= weight * a * x * w / float(n)
            want_grad[i, keep.nonzero()[t]] = -weight * a * w / float(n)
    lp = base.clone().requires_grad_()
    loss, m = policy_loss(lp, old, adv, mask, None, cap, kind="cispo", is_weights=is_w)
    loss.backward()
    assert loss.item() == pytest.approx(want_loss, rel=1e-10)
    torch.testing.assert_close(lp.grad, want_grad, atol=1e-12, rtol=1e-9)
    assert 0 < capped < n
    assert m.clipfrac_high.item() == pytest.approx(capped / float(n))
    assert m.clipfrac_low == 0 == m.clipfrac_dual
    assert (lp.grad[mask != 0] != 0).all(), "CISPO keeps a gradient on every token"


def test_cispo_has_no_dual_clip():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="no dual clip"):
        policy_loss(x, x, torch.zeros(1), torch.ones(1, 2), kind="cispo", clip_ratio_c=3.0)


def test_dr_grpo_by_hand():
    """Dr. GRPO eq. 3: the PPO clipped token terms (eps 0.2 both sides), summed, / (G x L_max)."""
    base, old, adv, mask = random_batch(13)
    L = 50
    g = int((mask.sum(-1) > 0).sum())
    want_loss, want_grad = 0.0, torch.zeros_like(base)
    for i, keep, lp_i, o, a in rows_of(base, old, adv, mask):
        for t, (x, y) in enumerate(zip(lp_i.tolist(), o.tolist())):
            r = math.exp(x - y)
            clipped = (a > 0 and r > 1.2) or (a < 0 and r < 0.8)
            obj = min(1.2, max(0.8, r)) * a if clipped else r * a
            want_loss -= obj / (g * L)
            want_grad[i, keep.nonzero()[t]] = 0.0 if clipped else -r * a / (g * L)
    lp = base.clone().requires_grad_()
    loss, m = policy_loss(lp, old, adv, mask, kind="dr_grpo", max_response_len=L)
    loss.backward()
    assert loss.item() == pytest.approx(want_loss, rel=1e-10)
    torch.testing.assert_close(lp.grad, want_grad, atol=1e-12, rtol=1e-9)
    assert m.clipfrac_high > 0 and m.clipfrac_low > 0
    with pytest.raises(ValueError, match="max_response_len"):
        policy_loss(lp, old, adv, mask, kind="dr_grpo")


def test_dr_grpo_advantages_are_centred_rewards():
    rewards = torch.tensor([[1.0, -1.0, -1.0, -1.0], [0.5, 0.5, 0.5, 0.5], [1.0, 1.0, -1.0, -0.7]])
    adv = group_advantages(rewards, scale_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([[1.5, -0.5, -0.5, -0.5], [0.0] * 4,
                                                  [0.925, 0.925, -1.075, -0.775]]))
    scaled = group_advantages(rewards)
    assert scaled[0, 0].item() == pytest.approx(1.5 / 1.0)  # std of (1, -1, -1, -1) is 1 (Bessel)
    assert policy_loss_spec("dr_grpo").scale_advantages_by_std is False
    assert all(policy_loss_spec(k).scale_advantages_by_std for k in ("dapo", "gspo", "cispo"))


def test_the_trainers_batch_takes_the_policy_losss_advantage_switch():
    from types import SimpleNamespace

    from megatron_dapo.config import load_config
    from megatron_dapo.train import train_batch
    from megatron_dapo.types import Group, Prompt, Sample

    def sample(reward):
        return Sample(prompt_ids=[1, 2], response_ids=[3], rollout_logprobs=[-0.5], finish_reason="stop",
                      reward=reward)

    prompt = Prompt(uid="a", messages=({"role": "user", "content": "1+0"},), ground_truth="1")
    groups = [Group(prompt, [sample(1.0), sample(0.0), sample(0.0)])]
    def run(loss):
        return SimpleNamespace(cfg=load_config(None, [f"algo.policy_loss={loss}"]), tokenizer=SimpleNamespace(pad_token_id=0))

    plain = train_batch(run("dr_grpo"), groups)
    torch.testing.assert_close(plain.advantages, torch.tensor([2 / 3, -1 / 3, -1 / 3]))
    scaled = train_batch(run("dapo"), groups)
    want = group_advantages(torch.tensor([[1.0, 0.0, 0.0]])).reshape(-1)
    torch.testing.assert_close(scaled.advantages, want)


def split_kwargs(kind: str, mode: str, mask: torch.Tensor) -> dict:
    if kind == "dr_grpo":
        return {"global_num_seqs": int((mask.sum(-1) > 0).sum()), "max_response_len": 40}
    return global_kwargs(mode, mask)


CLIP_FOR_TESTS = {"gspo": (0.03, 0.04), "cispo": (None, 1.2)}
"""Clip ranges the test batches hit (the defaults: GSPO's 3e-4 clips every sequence, CISPO's cap 5 none)."""
SPLIT_CASES = [(k, m) for k in KINDS for m in ("token-mean", "seq-mean-token-mean")
               if k != "dr_grpo" or m == "token-mean"]
"""(dr_grpo has one normaliser, sequences x L_max: loss_agg_mode does not apply to it.)"""


@pytest.mark.parametrize("kind, mode", SPLIT_CASES)
@pytest.mark.parametrize("corrected", [False, True], ids=["plain", "dual+is"])
def test_micro_batch_split_invariance(kind, mode, corrected):
    """Rows split into micro-batches in a random order, each normalised by the global counts, sum to the
    full batch's loss and gradient, for every variant (dr_grpo: its own constant)."""
    base, old, adv, mask = random_batch(14)
    is_w = torch.rand(base.shape, generator=torch.Generator().manual_seed(5), dtype=F64) * 2
    eps_low, eps_high = CLIP_FOR_TESTS.get(kind, (None, None))
    kw: dict[str, Any] = {"agg_mode": mode, "kind": kind, "eps_low": eps_low, "eps_high": eps_high}
    if corrected:
        kw["is_weights"] = is_w
        if policy_loss_spec(kind).dual_clip:
            kw["clip_ratio_c"] = 1.05 if kind == "gspo" else 1.2
    full_lp = base.clone().requires_grad_()
    full_kw: dict[str, Any] = {"max_response_len": 40} if kind == "dr_grpo" else {}
    full, m = policy_loss(full_lp, old, adv, mask, **kw, **full_kw)
    full.backward()
    assert m.clipfrac_high > 0
    split_lp = base.clone().requires_grad_()
    perm = torch.randperm(len(base), generator=torch.Generator().manual_seed(2))
    total = torch.zeros((), dtype=F64)
    for rows in torch.split(perm, [2, 5, 1, 3]):
        part = {k: v[rows] if torch.is_tensor(v) else v for k, v in kw.items()}
        loss, _ = policy_loss(split_lp[rows], old[rows], adv[rows], mask[rows], **part,
                              **split_kwargs(kind, mode, mask))
        loss.backward()
        total += loss.detach()
    torch.testing.assert_close(total, full.detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(split_lp.grad, full_lp.grad, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_padding_garbage_is_ignored_by_every_variant(kind):
    logprobs = torch.tensor([[-1.0, -torch.inf], [-2.0, float("nan")]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.2, 5.0], [-1.9, float("nan")]], dtype=F64)
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    loss, m = policy_loss(logprobs, old, torch.tensor([1.0, -1.0], dtype=F64), mask, kind=kind,
                          max_response_len=4)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all() and (logprobs.grad[:, 1] == 0).all()
    assert m.num_tokens.item() == 2 and all(torch.isfinite(v) for v in vars(m).values())


def test_the_registry_lists_the_config_names():
    assert tuple(k for k in REGISTRY if k in POLICY_LOSSES) == POLICY_LOSSES
    with pytest.raises(PolicyLossLoadError, match="unknown policy loss 'ppo'"):
        policy_loss_spec("ppo")


def test_a_users_loss_is_one_decorated_function():
    """algo.policy_loss=workers.custom_loss:halved_dapo: imported, its spec read from the decorator; the
    shared masking, weights and normalisers apply (half of DAPO's loss and gradient)."""
    base, old, adv, mask = random_batch(15)
    got_lp, want_lp = base.clone().requires_grad_(), base.clone().requires_grad_()
    got, _ = policy_loss(got_lp, old, adv, mask, kind="workers.custom_loss:halved_dapo")  # its eps: 0.1 / 0.1
    want, _ = policy_loss(want_lp, old, adv, mask, 0.1, 0.1)
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want / 2)
    torch.testing.assert_close(got_lp.grad, want_lp.grad / 2)
    assert got_lp.grad.abs().sum() > 0
    assert policy_loss_spec("workers.custom_loss:halved_dapo").name == "halved_dapo"
    with pytest.raises(ValueError, match="no dual clip"):  # not declared by its decorator: refused, not ignored
        policy_loss(base, old, adv, mask, kind="workers.custom_loss:halved_dapo", clip_ratio_c=3.0)


@pytest.mark.parametrize("name, fragment", [
    ("workers.custom_loss:undecorated", "not a function decorated"),
    ("workers.no_such_module:f", "cannot import 'workers.no_such_module'"),
    ("workers.custom_loss:missing", "not a function decorated"),
])
def test_a_users_loss_is_refused_in_one_line(name, fragment):
    with pytest.raises(PolicyLossLoadError, match=fragment):
        policy_loss_spec(name)


def test_a_name_cannot_be_taken_twice():
    with pytest.raises(PolicyLossLoadError, match="registered already"):
        register_policy_loss("gspo")(lambda x: x)  # type: ignore[arg-type,return-value]
    assert REGISTRY["gspo"].fn.__name__ == "gspo"


def test_the_start_up_summary_names_the_loss_and_where_it_runs():
    from megatron_dapo.config import load_config
    from megatron_dapo.loop.report import policy_loss_line

    def line(*overrides):
        return policy_loss_line(load_config(None, list(overrides)))

    assert line() == "dapo (eps_low 0.2, eps_high 0.28, token-mean); torch"
    assert line("algo.policy_loss=gspo", "algo.loss_agg_mode=seq-mean-token-mean") == \
        "gspo (eps_low 0.0003, eps_high 0.0004, seq-mean-token-mean); torch"
    assert line("algo.policy_loss=cispo") == "cispo (no lower bound, eps_high 5, token-mean); torch"
    assert line("algo.policy_loss=dr_grpo").startswith("dr_grpo (eps_low 0.2, eps_high 0.2, token sums / (sequences")
