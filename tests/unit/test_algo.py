import math

import pytest
import torch

from rlsearch.algo import grpo_advantages, kl_estimate, loss_token_weights, ppo_clip_terms


def test_grpo_equal_rewards_give_zero_not_nan():
    adv = grpo_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0]), [0, 0, 0, 1, 1, 1])
    assert torch.equal(adv, torch.zeros(6))


def test_grpo_values_normalised_per_group():
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0]), [0, 0, 0, 0, 1, 1])
    # group 0: mean 0.25, unbiased std 0.5 -> (0.75/0.5, -0.25/0.5, ...)
    assert adv[:4].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    # group 1: mean 3, std sqrt(2)
    assert adv[4:].tolist() == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)], abs=1e-5)


def test_grpo_without_std_and_singleton_group():
    adv = grpo_advantages(torch.tensor([3.0, 1.0, 5.0]), [7, 7, 9], norm_by_std=False)
    assert adv.tolist() == [1.0, -1.0, 0.0]


def test_ppo_clip_terms_clip_both_sides():
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.9]))
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    terms = ppo_clip_terms(new, old, adv, clip_ratio_low=0.2, clip_ratio_high=0.2)
    # A>0, r=1.5 -> clipped at 1.2; A<0, r=0.5 -> clipped at 0.8; inside the range -> unclipped
    assert terms.per_token_loss.tolist() == pytest.approx([-1.2, 0.8, -1.1, 0.9], abs=1e-6)
    assert terms.clipped.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_ppo_gradient_sign_increases_logprob_of_positive_advantage():
    logprob = torch.tensor([-2.0], requires_grad=True)
    terms = ppo_clip_terms(logprob, logprob.detach(), torch.tensor([1.0]), 0.2, 0.2)
    terms.per_token_loss.sum().backward()
    assert logprob.grad.item() == pytest.approx(-1.0)


def test_kl_estimators():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert kl_estimate(lp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    assert kl_estimate(lp, ref, "k2").tolist() == pytest.approx([0.125, 0.5])
    assert kl_estimate(lp, ref, "k3").tolist() == pytest.approx([math.exp(-0.5) - 1 + 0.5, math.exp(1) - 1 - 1])
    assert kl_estimate(lp, lp, "k3").tolist() == [0.0, 0.0]
    assert torch.isfinite(kl_estimate(torch.tensor([0.0]), torch.tensor([-1e9]), "k3")).all()
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(lp, ref, "k4")


def test_loss_token_weights_are_independent_of_batch_split():
    masks = [[0, 1, 1, 0], [1, 1, 1], [0, 0]]
    token = loss_token_weights(masks, "token_mean")
    assert sum(map(sum, token)) == pytest.approx(1.0)
    assert token[0] == [0.0, 0.2, 0.2, 0.0]
    seq = loss_token_weights(masks, "seq_mean_token_mean")
    assert seq[0] == pytest.approx([0.0, 0.25, 0.25, 0.0])
    assert seq[1] == pytest.approx([1 / 6] * 3)
    assert seq[2] == [0.0, 0.0]


def test_truncated_importance_weights_are_the_capped_ratio_and_carry_no_gradient():
    from rlsearch.algo import truncated_importance_weights

    logprobs = torch.tensor([-1.0, -2.0, -0.5, -3.0], requires_grad=True)
    rollout = torch.tensor([-1.0, -1.0, -2.0, -3.0 + 1e-6])
    weights = truncated_importance_weights(logprobs, rollout, cap=2.0)
    expected = torch.tensor([1.0, math.exp(-1.0), 2.0, math.exp(-1e-6)])  # exp(1.5) = 4.48 is capped at 2
    assert torch.allclose(weights, expected, atol=1e-7)
    assert not weights.requires_grad
    far = truncated_importance_weights(torch.tensor([0.0]), torch.tensor([-1000.0]), cap=5.0)
    assert far.item() == 5.0  # no overflow to inf before the cap
