"""Rollout-correction weights (TIS / MIS, token / sequence level) against hand arithmetic."""

import math
import typing
from typing import Any

import pytest
import torch

from megatron_dapo.algo.rollout_correction import CORRECTIONS, correction_spec, correction_weights
from megatron_dapo.config import AlgoConfig

F64 = torch.float64
NAN = float("nan")

# Token ratios pi_old / pi_rollout; None marks a masked position (its log-probs are garbage).
RATIOS: list[list[Any]] = [
    [3.0, 0.25, 1.5],  # one token above C = 2, one below 1/C
    [0.4, None, None],  # a sequence of one token
    [None, None, None],  # fully masked (e.g. overlong-filtered)
    [1.5, 1.5, 1.0],  # every token inside the band, but the product 2.25 is above C
]


def batch(dtype=F64):
    """(old, rollout, mask) with old - rollout = log(ratio) and rollout log-probs that vary."""
    mask = torch.tensor([[r is not None for r in row] for row in RATIOS], dtype=torch.float32)
    rollout = -torch.arange(1, 13, dtype=F64).reshape(4, 3) / 4
    log_r = torch.tensor([[math.log(r) if r is not None else NAN for r in row] for row in RATIOS], dtype=F64)
    old = rollout + log_r
    rollout = torch.where(mask.bool(), rollout, torch.tensor(-math.inf, dtype=F64))  # garbage where masked
    return old.to(dtype), rollout.to(dtype), mask


def weights(level, mode, **kw):
    old, rollout, mask = batch()
    return correction_weights(old, rollout, mask, level=level, mode=mode, **kw)


VALID = [3.0, 0.25, 1.5, 0.4, 1.5, 1.5, 1.0]  # the 7 valid ratios, row by row


def test_common_metrics_kl_k3_and_ppl_ratio():
    _, m = weights("token", "truncate")
    assert (m.num_tokens, m.num_seqs) == (7, 3)
    # k3: mean of r - 1 - log r over the valid tokens
    assert m.kl_k3 == pytest.approx(sum(r - 1 - math.log(r) for r in VALID) / 7)
    # ppl_train / ppl_rollout = exp(-mean old) / exp(-mean rollout), straight from the log-probs
    old, rollout, mask = batch()
    valid = mask.bool()
    ppl_train, ppl_rollout = torch.exp(-old[valid].mean()), torch.exp(-rollout[valid].mean())
    assert m.ppl_ratio == pytest.approx(float(ppl_train / ppl_rollout))
    assert m.ppl_ratio == pytest.approx(math.prod(VALID) ** (-1 / 7))


def test_token_truncate():
    w, m = weights("token", "truncate", threshold=2.0)
    want = torch.tensor([[2.0, 0.25, 1.5], [0.4, 0, 0], [0, 0, 0], [1.5, 1.5, 1.0]], dtype=F64)
    torch.testing.assert_close(w, want)
    assert m.clipped_frac == pytest.approx(1 / 7) and m.masked_frac is None
    assert m.weight_mean == pytest.approx((2 + 0.25 + 1.5 + 0.4 + 1.5 + 1.5 + 1) / 7)
    assert m.weight_max == pytest.approx(2.0)


def test_sequence_truncate_uses_the_log_ratio_sum():
    w, m = weights("sequence", "truncate", threshold=2.0)
    # products: 3 * 0.25 * 1.5 = 1.125; 0.4 (one token: same as token level); 1.5 * 1.5 * 1 = 2.25 -> 2
    want = torch.tensor([[1.125] * 3, [0.4, 0, 0], [0, 0, 0], [2.0] * 3], dtype=F64)
    torch.testing.assert_close(w, want)
    # a mean of the log ratios would give row 3 exp(log(2.25) / 3) = 1.31, not truncated
    assert m.clipped_frac == pytest.approx(1 / 3)  # 1 of 3 non-empty sequences
    assert m.weight_mean == pytest.approx((3 * 1.125 + 0.4 + 3 * 2.0) / 7)
    assert m.weight_max == pytest.approx(2.0)


def test_token_mask():
    w, m = weights("token", "mask", threshold=2.0)  # band [1/2, 2]
    want = torch.tensor([[0, 0, 1], [0, 0, 0], [0, 0, 0], [1, 1, 1]], dtype=F64)
    torch.testing.assert_close(w, want)
    assert m.masked_frac == pytest.approx(3 / 7) and m.clipped_frac is None
    assert m.weight_mean == pytest.approx(4 / 7) and m.weight_max == 1.0


def test_token_mask_explicit_low_end():
    w, m = weights("token", "mask", threshold=2.0, threshold_low=0.3)  # 0.4 now inside, 0.25 not
    want = torch.tensor([[0, 0, 1], [1, 0, 0], [0, 0, 0], [1, 1, 1]], dtype=F64)
    torch.testing.assert_close(w, want)
    assert m.masked_frac == pytest.approx(2 / 7)


def test_sequence_mask():
    w, m = weights("sequence", "mask", threshold=2.0)
    # 1.125 inside [0.5, 2]: the whole row kept although two of its tokens are outside; 0.4 and 2.25 dropped
    want = torch.tensor([[1, 1, 1], [0, 0, 0], [0, 0, 0], [0, 0, 0]], dtype=F64)
    torch.testing.assert_close(w, want)
    assert m.masked_frac == pytest.approx(2 / 3) and m.weight_mean == pytest.approx(3 / 7)


def test_one_token_sequences_agree_across_levels():
    old = torch.tensor([[-1.0], [-2.0], [-0.1]])
    rollout = torch.tensor([[-2.5], [-2.2], [-0.1]])
    mask = torch.ones(3, 1)
    for mode in ("truncate", "mask"):
        token, mt = correction_weights(old, rollout, mask, level="token", mode=mode)
        seq, ms = correction_weights(old, rollout, mask, level="sequence", mode=mode)
        torch.testing.assert_close(token, seq)
        assert mt.weight_mean == pytest.approx(ms.weight_mean)
    w, _ = correction_weights(old, rollout, mask, mode="truncate")
    torch.testing.assert_close(w, torch.tensor([[2.0], [math.exp(0.2)], [1.0]]))


def test_fully_masked_batch():
    old = torch.randn(2, 3)
    for level in ("token", "sequence"):
        for mode in ("truncate", "mask"):
            w, m = correction_weights(old, old + 5, torch.zeros(2, 3), level=level, mode=mode)
            assert (w == 0).all()
            assert (m.weight_mean, m.weight_max, m.kl_k3, m.ppl_ratio) == (0, 0, 0, 1)
            assert (m.num_tokens, m.num_seqs) == (0, 0)
            assert (m.clipped_frac or 0.0) == 0.0 and (m.masked_frac or 0.0) == 0.0


def test_extreme_sequence_log_ratios_stay_finite_in_fp32():
    old = torch.tensor([[400.0, 400.0], [-400.0, -400.0]])  # exp(800) and exp(-800) overflow / underflow
    rollout, mask = torch.zeros(2, 2), torch.ones(2, 2)
    w, m = correction_weights(old, rollout, mask, level="sequence", mode="truncate")
    torch.testing.assert_close(w, torch.tensor([[2.0, 2.0], [0.0, 0.0]]))
    w, m = correction_weights(old, rollout, mask, level="sequence", mode="mask")
    assert (w == 0).all() and m.masked_frac == 1.0


def test_weights_are_constants_in_the_input_dtype():
    old, rollout, mask = batch(torch.float32)
    old.requires_grad_()
    w, _ = correction_weights(old, rollout, mask)
    assert not w.requires_grad and w.dtype == torch.float32


def test_kl_k3_estimates_kl_rollout_to_train():
    """Tokens drawn from pi_rollout = q: mean k3 -> KL(q || p), not KL(p || q)."""
    q = torch.tensor([0.9, 0.05, 0.05], dtype=F64)
    p = torch.tensor([0.5, 0.25, 0.25], dtype=F64)
    kl_qp, kl_pq = float((q * (q / p).log()).sum()), float((p * (p / q).log()).sum())  # 0.368, 0.511
    tokens = torch.multinomial(q, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    old, rollout = p.log()[tokens][None], q.log()[tokens][None]
    _, m = correction_weights(old, rollout, torch.ones_like(old))
    assert m.kl_k3 == pytest.approx(kl_qp, abs=0.01)
    assert abs(m.kl_k3 - kl_pq) > 0.1


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"level": "row"}, "level"),
        ({"mode": "clip"}, "mode"),
        ({"threshold": 0.0}, "threshold"),
        ({"mode": "mask", "threshold": 2.0, "threshold_low": 2.0}, "threshold_low"),
        ({"mode": "mask", "threshold": 1.0}, "threshold_low"),  # default band [1, 1] is empty
    ],
)
def test_validation(kw, match):
    old, rollout, mask = batch()
    with pytest.raises(ValueError, match=match):
        correction_weights(old, rollout, mask, **kw)
    with pytest.raises(ValueError, match="shape"):
        correction_weights(old, rollout[:, :2], mask)


def test_config_names_map_to_level_and_mode():
    names = typing.get_args(typing.get_type_hints(AlgoConfig)["rollout_correction"])
    assert set(names) == {"auto", "none", *CORRECTIONS}  # auto: resolved by Config.rollout_correction()
    assert correction_spec("none") is None
    assert correction_spec("token_tis") == ("token", "truncate")
    assert correction_spec("seq_tis") == ("sequence", "truncate")
    assert correction_spec("token_mis") == ("token", "mask")
    assert correction_spec("seq_mis") == ("sequence", "mask")
    with pytest.raises(ValueError, match="token_tis"):
        correction_spec("tis")
