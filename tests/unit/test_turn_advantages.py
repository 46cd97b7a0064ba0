"""Turn-level credit (algo.advantage): discounted returns, and each turn's advantage under turn_returns and gigpo for
small groups of two-turn trajectories worked out by hand."""

from __future__ import annotations

import pytest
import torch

from rlsearch.algo import discounted_returns, gigpo_advantages, grpo_advantages, turn_return_advantages


def test_discounted_returns_add_the_discounted_rewards_after_each_step():
    assert discounted_returns([1.0, 2.0, 3.0], 0.5) == [1.0 + 0.5 * 2.0 + 0.25 * 3.0, 2.0 + 0.5 * 3.0, 3.0]
    assert discounted_returns([1.0, 2.0], 1.0) == [3.0, 2.0]
    assert discounted_returns([], 0.9) == []


# a group of two trajectories of two turns: the first's first search found the answer and it answered right (outcome
# 1), the second found nothing and answered wrong (0); Dr. GRPO's outcome advantages (no std): +0.5 and -0.5
TURN_REWARDS = [[1.0, 0.0], [0.0, 0.0]]
OUTCOMES = torch.tensor([0.5, -0.5])


def test_turn_returns_add_the_discounted_normalised_turn_rewards_to_the_outcome_advantage():
    advantages = turn_return_advantages(OUTCOMES, TURN_REWARDS, [0, 0], gamma=0.5, weight=1.0, norm_by_std=False)
    # turn rewards 1, 0, 0, 0 over the group: mean 0.25, so 0.75, -0.25, -0.25, -0.25; returns from each turn:
    # first trajectory 0.75 + 0.5 * -0.25 = 0.625 and -0.25, second -0.25 + 0.5 * -0.25 = -0.375 and -0.25
    assert advantages == [pytest.approx([1.125, 0.25], abs=1e-6), pytest.approx([-0.875, -0.75], abs=1e-6)]
    doubled = turn_return_advantages(OUTCOMES, TURN_REWARDS, [0, 0], gamma=0.5, weight=2.0, norm_by_std=False)
    assert doubled == [pytest.approx([1.75, 0.0], abs=1e-6), pytest.approx([-1.25, -1.0], abs=1e-6)]
    # with the std: the turn rewards' unbiased std is 0.5, so each normalised reward doubles (eps 1e-6)
    scaled = turn_return_advantages(OUTCOMES, TURN_REWARDS, [0, 0], gamma=0.5, weight=1.0, eps=1e-6)
    unit = 1 / (0.5 + 1e-6)
    assert scaled == [pytest.approx([0.5 + 0.625 * unit, 0.5 - 0.25 * unit], abs=1e-6),
                      pytest.approx([-0.5 - 0.375 * unit, -0.5 - 0.25 * unit], abs=1e-6)]


def test_turn_returns_of_equal_turn_rewards_are_the_outcome_advantages():
    equal = turn_return_advantages(OUTCOMES, [[1.0, 1.0], [1.0]], [0, 0], gamma=0.9, weight=1.0)
    assert equal == [pytest.approx([0.5, 0.5]), pytest.approx([-0.5])]
    # groups are normalised apart: a group of one trajectory of one turn has no baseline; the other group's turn
    # rewards 0 and 2 become -1 and 1, whose returns (gamma 1) are 0 and 1
    alone = turn_return_advantages(torch.tensor([0.0, 0.0]), [[3.0], [0.0, 2.0]], [0, 1], 1.0, 1.0, False)
    assert alone == [[0.0], [0.0, 1.0]]


def test_gigpo_compares_the_returns_of_turns_that_share_a_state():
    # three trajectories of one group; every first turn starts from the prompt (state "prompt"), the second turns of
    # the first two saw the same observation (A), the third's another (B). Outcome rewards 1, 0, 1: mean 2/3
    turn_rewards, outcome_rewards = [[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]], [1.0, 0.0, 1.0]
    outcome = grpo_advantages(torch.tensor(outcome_rewards), [0, 0, 0], norm_by_std=False)
    assert outcome.tolist() == pytest.approx([1 / 3, -2 / 3, 1 / 3])
    states = [["prompt", "A"], ["prompt", "A"], ["prompt", "B"]]
    advantages = gigpo_advantages(outcome, turn_rewards, outcome_rewards, states, [0, 0, 0], gamma=0.5, weight=1.0,
                                  norm_by_std=False)
    # returns with the outcome at the last turn (gamma 0.5): [1.5, 1], [0, 0], [1, 2]. First turns: mean 5/6, so
    # 2/3, -5/6, 1/6; second turns in A: mean 0.5, so 0.5, -0.5; the one in B is alone: 0
    assert advantages == [pytest.approx([1 / 3 + 2 / 3, 1 / 3 + 0.5], abs=1e-6),
                          pytest.approx([-2 / 3 - 5 / 6, -2 / 3 - 0.5], abs=1e-6),
                          pytest.approx([1 / 3 + 1 / 6, 1 / 3], abs=1e-6)]


def test_gigpo_step_groups_stay_within_their_group_and_a_trajectory_without_turns_gets_none():
    outcome = torch.tensor([0.25, -0.25, 0.0])
    advantages = gigpo_advantages(outcome, [[1.0], [0.0], []], [1.0, 0.0, 0.0], [["s"], ["s"], []], [0, 1, 1],
                                  gamma=1.0, weight=1.0, norm_by_std=False)
    # the same state in two groups is two step groups of one turn each: nothing to compare
    assert advantages == [[0.25], [-0.25], []]
