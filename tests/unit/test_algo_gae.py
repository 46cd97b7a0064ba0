"""Per-token returns and advantages (rlsearch.algo.returns) and the group baselines of RLOO and REINFORCE++-baseline,
against figures worked out by hand."""

from __future__ import annotations

import math
import random

import pytest
import torch

from rlsearch.algo import (
    explained_variance,
    gae,
    group_mean_baseline,
    reward_to_go,
    rloo_advantages,
    trajectory_gae,
    whiten,
)

GAMMA, LAM = 0.9, 0.8
# the policy's three steps: values 0.5, 0.6, 0.8, the reward 1 on the last, bootstrap 0 (gamma lam = 0.72):
#   delta_2 = 1 - 0.8 = 0.2                  A_2 = 0.2
#   delta_1 = 0.9 x 0.8 - 0.6 = 0.12         A_1 = 0.12 + 0.72 x 0.2 = 0.264
#   delta_0 = 0.9 x 0.6 - 0.5 = 0.04         A_0 = 0.04 + 0.72 x 0.264 = 0.23008
# returns A + V: 0.73008, 0.864, 1.0
STEP_ADVANTAGES = [0.23008, 0.264, 0.2]
STEP_RETURNS = [0.73008, 0.864, 1.0]


def _approx(nested):
    return [pytest.approx(row, abs=1e-6) for row in nested]


def test_gae_on_a_sequence_of_steps():
    advantages, returns = gae([0.0, 0.0, 1.0], [0.5, 0.6, 0.8], GAMMA, LAM)
    assert advantages == pytest.approx(STEP_ADVANTAGES, abs=1e-6)
    assert returns == pytest.approx(STEP_RETURNS, abs=1e-6)
    with pytest.raises(ValueError, match="2 rewards for 3 values"):
        gae([0.0, 1.0], [0.5, 0.6, 0.8], GAMMA, LAM)


def test_observation_tokens_are_skipped_not_decayed():
    # two tool-output tokens (mask 0; their values 9 are never read) between the second and third sampled token
    masks = [[1, 1, 0, 0, 1]]
    advantages, returns = trajectory_gae(masks, [[0.5, 0.6, 9.0, 9.0, 0.8]], 1.0, GAMMA, LAM)
    assert advantages == _approx([[0.23008, 0.264, 0.0, 0.0, 0.2]])
    assert returns == _approx([[0.73008, 0.864, 0.0, 0.0, 1.0]])
    # the trap: every response token a step, values and rewards zeroed at the gap (OpenRLHF):
    #   A_4 = 0.2; A_3 = 0.9 x 0.8 + 0.72 x 0.2 = 0.864; A_2 = 0.72 x 0.864 = 0.62208;
    #   A_1 = -0.6 + 0.72 x 0.62208 = -0.1521024, where the compressed sequence gives 0.264
    every_token = gae([0.0, 0.0, 0.0, 0.0, 1.0], [0.5, 0.6, 0.0, 0.0, 0.8], GAMMA, LAM)[0]
    assert every_token[1] == pytest.approx(-0.1521024, abs=1e-6)


def test_gae_carries_across_folded_segments():
    # the same three steps over two segments: a sampled token, an observation, a sampled token | an observation, the
    # last sampled token. Neither the segment boundary nor the observations reset or decay the estimate
    masks = [[1, 0, 1], [0, 1]]
    advantages, returns = trajectory_gae(masks, [[0.5, 7.0, 0.6], [7.0, 0.8]], 1.0, GAMMA, LAM)
    assert advantages == _approx([[0.23008, 0.0, 0.264], [0.0, 0.2]])
    assert returns == _approx([[0.73008, 0.0, 0.864], [0.0, 1.0]])


def test_truncated_trajectory_bootstraps_from_the_value_after_it():
    # cut after two steps, no reward, V after the cut 0.7:
    #   delta_1 = 0.9 x 0.7 - 0.6 = 0.03       A_1 = 0.03
    #   delta_0 = 0.9 x 0.6 - 0.5 = 0.04       A_0 = 0.04 + 0.72 x 0.03 = 0.0616
    advantages, returns = trajectory_gae([[1, 1]], [[0.5, 0.6]], 0.0, GAMMA, LAM, bootstrap=0.7)
    assert advantages == _approx([[0.0616, 0.03]])
    assert returns == _approx([[0.5616, 0.63]])
    # bootstrap 0 (rlsearch's default: a cut ends the trajectory): delta_1 = -0.6, A_0 = 0.04 - 0.432 = -0.392
    assert trajectory_gae([[1, 1]], [[0.5, 0.6]], 0.0, GAMMA, LAM)[0] == _approx([[-0.392, -0.6]])


def test_lambda_one_gives_return_minus_value():
    # G = 0.81, 0.9, 1 (the reward discounted by 0.9 per later sampled token; the observation is no step)
    masks, values = [[1, 1, 0, 1]], [[0.2, 0.4, 5.0, 0.1]]
    advantages, returns = trajectory_gae(masks, values, 1.0, GAMMA, 1.0)
    assert advantages == _approx([[0.81 - 0.2, 0.9 - 0.4, 0.0, 1.0 - 0.1]])
    assert returns == _approx([[0.81, 0.9, 0.0, 1.0]])


def test_gamma_and_lambda_one_with_zero_values_is_reinforce():
    masks = [[1, 0, 1], [1]]
    advantages, returns = trajectory_gae(masks, [[0.0] * 3, [0.0]], 0.7, 1.0, 1.0)
    assert advantages == [[0.7, 0.0, 0.7], [0.7]]
    assert returns == [[0.7, 0.0, 0.7], [0.7]]
    assert reward_to_go(masks, 0.7, 1.0) == [[0.7, 0.0, 0.7], [0.7]]


def test_lambda_zero_gives_the_one_step_td_error():
    advantages, returns = trajectory_gae([[1, 1, 1]], [[0.5, 0.6, 0.8]], 1.0, GAMMA, 0.0)
    assert advantages == _approx([[0.04, 0.12, 0.2]])  # the deltas above
    assert returns == _approx([[0.54, 0.72, 1.0]])  # r_t + gamma V_(t+1)


def test_value_lambda_apart_from_the_policy_lambda():
    # VAPO: the advantages with lam 0.8 as above, the value targets with lambda 1 (the discounted returns)
    advantages, returns = trajectory_gae([[1, 1, 1]], [[0.5, 0.6, 0.8]], 1.0, GAMMA, LAM, value_lam=1.0)
    assert advantages == _approx([STEP_ADVANTAGES])
    assert returns == _approx([[0.81, 0.9, 1.0]])


def test_token_rewards_count_at_sampled_tokens_only():
    # step rewards -0.1 and -0.2 + 1 = 0.8 (the 5.0 is at an observation); gamma = lam = 1, V = 0: A = G = 0.7, 0.8
    masks, token_rewards = [[1, 0, 1]], [[-0.1, 5.0, -0.2]]
    advantages, returns = trajectory_gae(masks, [[0.0] * 3], 1.0, 1.0, 1.0, token_rewards=token_rewards)
    assert advantages == _approx([[0.7, 0.0, 0.8]])
    assert returns == _approx([[0.7, 0.0, 0.8]])
    # gamma 0.5: G_1 = 0.8, G_0 = -0.1 + 0.5 x 0.8 = 0.3
    assert reward_to_go(masks, 1.0, 0.5, token_rewards) == _approx([[0.3, 0.0, 0.8]])


def test_a_trajectory_without_sampled_tokens_gets_zeros():
    assert trajectory_gae([[0, 0], [0]], [[1.0, 2.0], [3.0]], 1.0, GAMMA, LAM) == ([[0.0, 0.0], [0.0]],) * 2
    assert reward_to_go([[0, 0]], 1.0, GAMMA) == [[0.0, 0.0]]
    with pytest.raises(ValueError, match="differ in shape"):
        trajectory_gae([[1, 1]], [[0.5]], 1.0, GAMMA, LAM)


def test_reward_to_go_discounts_per_sampled_token():
    # three steps over two segments, gamma 0.5: 0.25, 0.5, 1
    assert reward_to_go([[1, 1, 0], [0, 1]], 1.0, 0.5) == [[0.25, 0.5, 0.0], [0.0, 1.0]]


def test_whiten_over_the_masked_entries_of_the_batch():
    # 1, 2, 3 trained (the 99 is masked): mean 2, unbiased std 1
    values, masks = [[1.0, 99.0, 2.0], [3.0]], [[1, 0, 1], [1]]
    whitened = whiten(values, masks)
    assert whitened == _approx([[-1.0, 0.0, 0.0], [1.0]])
    assert whitened[0][1] == 0.0
    assert whiten(values, masks, shift_mean=False) == _approx([[1.0, 0.0, 2.0], [3.0]])
    assert whiten([[5.0]], [[1]]) == [[0.0]]  # one entry: std 0
    assert whiten([[5.0]], [[0]]) == [[0.0]]
    generator = random.Random(0)
    masks = [[generator.randint(0, 1) for _ in range(length)] for length in (7, 3, 11)]
    values = [[generator.uniform(-3.0, 5.0) for _ in mask] for mask in masks]
    trained = torch.tensor([v for row, mask in zip(whiten(values, masks), masks) for v, m in zip(row, mask) if m])
    assert trained.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert trained.std(unbiased=True).item() == pytest.approx(1.0, abs=1e-6)


def test_explained_variance():
    # R - V = 0, 0, 1: Var 1/3 - 1/9 = 2/9; Var(R) = 7 - 49/9 = 14/9; 1 - 1/7
    assert explained_variance([1.0, 2.0, 3.0], [1.0, 2.0, 4.0]) == pytest.approx(6 / 7, abs=1e-9)
    assert explained_variance(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])) == 1.0
    assert math.isnan(explained_variance([1.0, 2.0], [3.0, 3.0]))
    # equal returns as GAE gives them in float32 (A + V, rounded): no variance to explain, not -1e31 (a PPO run's
    # step where every trajectory got reward 0.2 printed EV -2.5e31)
    values = torch.tensor([0.1234567, -0.3141592, 0.5772156], dtype=torch.float32)
    returns = (0.2 - values) + values
    assert returns.var(unbiased=False) > 0
    assert math.isnan(explained_variance(values, returns))
    assert math.isnan(explained_variance([], []))


def test_rloo_leaves_each_sample_out_of_its_baseline():
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 0.5, 2.0, 7.0]), [0, 0, 0, 1, 1, 2]
    # group 0: 1 - 0, 0 - (1 + 0) / 2, ...; group 1: 0.5 - 2, 2 - 0.5; group 2 is one sample: 0
    assert rloo_advantages(rewards, groups).tolist() == pytest.approx([1.0, -0.5, -0.5, -1.5, 1.5, 0.0], abs=1e-6)


def test_group_mean_baseline():
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 0.5, 2.0, 7.0]), [0, 0, 0, 1, 1, 2]
    # group 0: mean 1/3; group 1: mean 1.25; group 2: one sample, 0
    assert group_mean_baseline(rewards, groups).tolist() == pytest.approx(
        [2 / 3, -1 / 3, -1 / 3, -0.75, 0.75, 0.0], abs=1e-6)
    with pytest.raises(ValueError, match="one group id per reward"):
        group_mean_baseline(rewards, [0, 1])
