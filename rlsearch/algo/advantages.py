"""Group-relative advantages (GRPO)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def grpo_advantages(
    rewards: torch.Tensor, group_ids: Sequence[int], norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Per-sequence advantages: reward minus its group's mean, divided by the group's std when asked.

    Groups are identified by `group_ids` (one per reward, any hashable ints). A group whose rewards are all
    equal gets zeros; a group of one sample gets zero (no baseline to compare with). Never NaN.
    """
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
        centred = group_rewards - group_rewards.mean()
        if norm_by_std:
            centred = centred / (group_rewards.std(unbiased=True) + eps)
        advantages[members] = centred
    return advantages.float()
