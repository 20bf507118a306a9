"""Group advantages against hand arithmetic (unbiased std, as torch.std in GRPO/verl)."""

import math

import pytest
import torch

from megatron_dapo.algo.advantages import group_advantages


def test_one_correct_of_four():
    # mean -0.5; deviations 1.5, -0.5 x3; unbiased var = (2.25 + 3 * 0.25) / 3 = 1 -> std 1.
    adv = group_advantages(torch.tensor([[1.0, -1.0, -1.0, -1.0]]), eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([[1.5, -0.5, -0.5, -0.5]]))


def test_two_of_four_and_eps():
    # mean 0; var = 4 / 3 -> std = 2/sqrt(3); A = +-sqrt(3)/2 / (1 + eps * sqrt(3)/2)
    eps = 1e-6
    adv = group_advantages(torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64), eps=eps)
    a = 1.0 / (2.0 / math.sqrt(3.0) + eps)
    torch.testing.assert_close(adv, torch.tensor([[a, a, -a, -a]], dtype=torch.float64))


def test_soft_overlong_rewards_and_rows_are_independent():
    rewards = torch.tensor([[1.0, -1.0, -1.5], [0.0, 3.0, 6.0]], dtype=torch.float64)
    adv = group_advantages(rewards, eps=0.0)
    # row 0: mean -0.5, devs 1.5, -0.5, -1.0; var = (2.25 + 0.25 + 1) / 2 = 1.75
    s = math.sqrt(1.75)
    torch.testing.assert_close(adv[0], torch.tensor([1.5 / s, -0.5 / s, -1.0 / s], dtype=torch.float64))
    # row 1: mean 3, devs -3, 0, 3; var = 18 / 2 = 9 -> std 3
    torch.testing.assert_close(adv[1], torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64))


def test_zero_variance_groups_are_exactly_zero():
    rewards = torch.tensor([[1.0] * 16, [-1.0] * 16, [0.1] * 16, [1.0] + [-1.0] * 15])
    adv = group_advantages(rewards)
    assert torch.equal(adv[:3], torch.zeros(3, 16))
    assert adv[3, 0] > 0 and (adv[3, 1:] < 0).all()


def test_integer_rewards_promoted():
    adv = group_advantages(torch.tensor([[1, -1, -1, -1]]), eps=0.0)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([[1.5, -0.5, -0.5, -0.5]]))


@pytest.mark.parametrize("shape", [(4,), (2, 1), (2, 3, 4)])
def test_bad_shapes(shape):
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(shape))
