"""Group-relative advantages: GRPO's, RLOO's and REINFORCE++-baseline's per trajectory, and per turn from turn
rewards (discounted turn returns, GiGPO's step groups)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence

import torch


def grpo_advantages(
    rewards: torch.Tensor, group_ids: Sequence[int], norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Per-sequence advantages: reward minus its group's mean, divided by the group's std when asked.

    Groups are identified by `group_ids` (one per reward, any hashable ints). A group whose rewards are all
    equal gets zeros; a group of one sample gets zero (no baseline to compare with). Never NaN.
    """
    return _centred_per_group(
        rewards, group_ids, lambda group: 1.0 / (group.std(unbiased=True) + eps) if norm_by_std else 1.0)


def rloo_advantages(rewards: torch.Tensor, group_ids: Sequence[int]) -> torch.Tensor:
    """RLOO (Ahmadian et al., 2024, arXiv 2402.14740): each reward minus the mean of the OTHER samples of its group,
    r_i - sum_(j != i) r_j / (n - 1) = n / (n - 1) x (r_i - mean). No std; a group of one sample gets zero."""
    return _centred_per_group(rewards, group_ids, lambda group: len(group) / (len(group) - 1))


def group_mean_baseline(rewards: torch.Tensor, group_ids: Sequence[int]) -> torch.Tensor:
    """REINFORCE++-baseline's first step (arXiv 2501.03262; verl, slime, OpenRLHF): each reward minus its group's
    mean, r_i - mean, before the whitening over the whole batch (`rlsearch.algo.whiten`). A group of one gets zero."""
    return grpo_advantages(rewards, group_ids, norm_by_std=False)


def _centred_per_group(
    rewards: torch.Tensor, group_ids: Sequence[int], scale: Callable[[torch.Tensor], float | torch.Tensor]
) -> torch.Tensor:
    """Each reward minus its group's mean, times `scale` of the group's rewards (float64); groups of one get 0."""
    if rewards.dim() != 1 or len(group_ids) != rewards.numel():
        raise ValueError("rewards must be 1-D with one group id per reward")
    rewards = rewards.double()
    advantages = torch.zeros_like(rewards)
    ids = torch.as_tensor(list(group_ids))
    for group in ids.unique():
        members = ids == group
        group_rewards = rewards[members]
        if group_rewards.numel() < 2:
            continue
        advantages[members] = (group_rewards - group_rewards.mean()) * scale(group_rewards)
    return advantages.float()


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """G_k = r_k + gamma * G_(k+1): each step's reward and the discounted rewards after it."""
    returns, running = [], 0.0
    for reward in reversed(rewards):
        running = reward + gamma * running
        returns.append(running)
    return returns[::-1]


def turn_return_advantages(
    outcome_advantages: torch.Tensor, turn_rewards: Sequence[Sequence[float]], group_ids: Sequence[int],
    gamma: float, weight: float, norm_by_std: bool = True, eps: float = 1e-6,
) -> list[list[float]]:
    """Per trajectory, each turn's advantage: its outcome advantage plus `weight` times the discounted sum of the
    normalised turn rewards from that turn on, A_k = A + weight * sum_(j >= k) gamma^(j-k) r~_j. The turn rewards
    are normalised as GRPO normalises outcomes (`grpo_advantages`), over every turn of the trajectory's group
    (DeepSeekMath's process supervision): equal turn rewards add nothing."""
    normalised = grpo_advantages(
        torch.tensor([reward for rewards in turn_rewards for reward in rewards], dtype=torch.float),
        [group for group, rewards in zip(group_ids, turn_rewards) for _ in rewards], norm_by_std, eps,
    ).tolist()
    own = _per_trajectory(normalised, [len(rewards) for rewards in turn_rewards])
    return _plus_outcome(outcome_advantages, [discounted_returns(values, gamma) for values in own], weight)


def gigpo_advantages(
    outcome_advantages: torch.Tensor, turn_rewards: Sequence[Sequence[float]], outcome_rewards: Sequence[float],
    turn_states: Sequence[Sequence[Hashable]], group_ids: Sequence[int], gamma: float, weight: float,
    norm_by_std: bool = True, eps: float = 1e-6,
) -> list[list[float]]:
    """GiGPO (Feng et al., 2025): per trajectory, each turn's advantage is its outcome advantage plus `weight` times
    its step advantage, A_k = A + weight * (G_k - mean) / (std + eps), over the step group of the turn: the turns of
    its group whose state (`turn_states`, any hashable) is the same. G_k is the trajectory's discounted return from
    turn k, its turn rewards and its outcome reward at the last turn, sum_(j >= k) gamma^(j-k) r_j +
    gamma^(K-1-k) R. A turn alone in its state, or in a step group of equal returns, adds nothing."""
    returns = [discounted_returns([*rewards[:-1], rewards[-1] + outcome], gamma) if rewards else []
               for rewards, outcome in zip(turn_rewards, outcome_rewards)]
    step_groups: dict[tuple[int, Hashable], int] = {}
    step_ids = [step_groups.setdefault((group, state), len(step_groups))
                for group, states in zip(group_ids, turn_states) for state in states]
    step = grpo_advantages(torch.tensor([value for values in returns for value in values], dtype=torch.float),
                           step_ids, norm_by_std, eps).tolist()
    return _plus_outcome(outcome_advantages, _per_trajectory(step, [len(values) for values in returns]), weight)


def _per_trajectory(flat: list[float], lengths: Sequence[int]) -> list[list[float]]:
    """`flat` (every trajectory's turns, in order) cut back into one list per trajectory of `lengths`."""
    starts = [0, *itertools.accumulate(lengths)]
    return [flat[start:end] for start, end in zip(starts, starts[1:])]


def _plus_outcome(outcome_advantages: torch.Tensor, per_turn: list[list[float]], weight: float) -> list[list[float]]:
    """Each turn's advantage: its trajectory's outcome advantage plus `weight` times the turn's own term."""
    return [[outcome + weight * value for value in values]
            for outcome, values in zip(outcome_advantages.tolist(), per_turn)]
