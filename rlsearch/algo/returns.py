"""Per-token returns and advantages of one trajectory from its policy's tokens: GAE from a critic's values and
REINFORCE++'s reward-to-go; whitening over a batch; a critic's explained variance. Plain lists in and out.

A trajectory's sampled tokens may lie in several segments (rollout.context fold or drop_observations: each segment is
a training sample of its own) with observation tokens (tool output, loss mask 0) between them. Only the tokens the
policy sampled (mask 1) are steps of the MDP: the estimates run over that compressed sequence of steps, so neither an
observation nor a segment boundary decays the reward or resets the trace. Search-R1, slime and OpenRLHF treat every
response token as a step, and their terminal reward decays by (gamma lam)^gap across tool outputs (miles PR #1827;
verl PR #2337 and NeMo-RL carry the trace across as here). The trajectory's reward sits on its last sampled token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .advantages import discounted_returns

PerToken = Sequence[Sequence[float]]  # one list per segment (or per sample), one entry per response token
Masks = Sequence[Sequence[int]]  # the same shape: 1 where the policy sampled the token


def gae(
    rewards: Sequence[float], values: Sequence[float], gamma: float, lam: float, bootstrap: float = 0.0
) -> tuple[list[float], list[float]]:
    """Generalised advantage estimation (Schulman et al., 2015, arXiv 1506.02438) over a sequence of steps:
    delta_t = r_t + gamma V_(t+1) - V_t with V_T = `bootstrap` after the last step (0: terminal),
    A_t = delta_t + gamma lam A_(t+1), and the critic's targets returns_t = A_t + V_t. lam = 1 gives the discounted
    return minus the value (A_t = G_t - V_t); lam = 0 the one-step TD error."""
    if len(rewards) != len(values):
        raise ValueError(f"{len(rewards)} rewards for {len(values)} values")
    advantages = [0.0] * len(rewards)
    running, next_value = 0.0, bootstrap
    for step in reversed(range(len(rewards))):
        running = rewards[step] + gamma * next_value - values[step] + gamma * lam * running
        advantages[step] = running
        next_value = values[step]
    return advantages, [advantage + value for advantage, value in zip(advantages, values)]


def trajectory_gae(
    masks: Masks, values: PerToken, reward: float, gamma: float, lam: float, value_lam: float | None = None,
    token_rewards: PerToken | None = None, bootstrap: float = 0.0,
) -> tuple[list[list[float]], list[list[float]]]:
    """`gae` of one trajectory, per segment per response token: (advantages with `lam`, returns with `value_lam`).

    The steps are the mask-1 tokens of every segment in order, with the critic's `values` there. Each step's reward
    is its `token_rewards` entry (a per-token penalty such as -kl_coef x KL; none: 0), and the last step's also the
    trajectory's `reward`. `value_lam` (None: `lam`) gives the critic's targets their own lambda (VAPO's decoupled
    GAE, arXiv 2504.05118: 1 for the values, 0.95 for the policy). `bootstrap` is the value after the last step: 0 for
    an ended trajectory, and for one cut by a budget too (rlsearch treats a cut as the end). Masked positions get 0.0;
    a trajectory without a sampled token gets zeros."""
    step_rewards = _step_rewards(masks, reward, token_rewards)
    step_values = sampled_entries(values, masks)
    advantages, returns = gae(step_rewards, step_values, gamma, lam, bootstrap)
    if value_lam is not None and value_lam != lam:
        returns = gae(step_rewards, step_values, gamma, value_lam, bootstrap)[1]
    return _scatter(advantages, masks), _scatter(returns, masks)


def reward_to_go(
    masks: Masks, reward: float, gamma: float, token_rewards: PerToken | None = None
) -> list[list[float]]:
    """REINFORCE++'s return per token (Hu, 2025, arXiv 2501.03262): G_t = r_t + gamma G_(t+1) over the mask-1 tokens of
    every segment in order, the step rewards as in `trajectory_gae` (the trajectory's `reward` on its last sampled
    token, `token_rewards` at sampled tokens). Masked positions get 0.0."""
    return _scatter(discounted_returns(_step_rewards(masks, reward, token_rewards), gamma), masks)


def whiten(per_token: PerToken, masks: Masks, eps: float = 1e-8, shift_mean: bool = True) -> list[list[float]]:
    """(x - mean) / (std + eps) over every mask-1 entry of the batch; masked entries stay 0.0. The std is the unbiased
    one (Bessel's n - 1, as verl's masked_whiten), 0 for a single entry. shift_mean=False adds the mean back,
    (x - mean) / (std + eps) + mean (verl's and TRL's masked_whiten): the scale is normalised, not the sign."""
    flat = torch.tensor(sampled_entries(per_token, masks), dtype=torch.float64)
    if flat.numel() == 0:
        return _scatter([], masks)
    mean = flat.mean()
    std = flat.std(unbiased=True) if flat.numel() > 1 else torch.zeros(())
    whitened = (flat - mean) / (std + eps)
    if not shift_mean:
        whitened = whitened + mean
    return _scatter(whitened.tolist(), masks)


def explained_variance(values: Sequence[float] | torch.Tensor, returns: Sequence[float] | torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) of a critic's values V against its targets R (flat, population variances): 1 for a
    perfect critic, 0 for one that predicts the mean return, below 0 for worse. NaN when the returns do not vary
    (nothing to explain: Var(R) at most 1e-12 E[R^2], what float32 rounding of equal returns leaves, which would
    otherwise give -1e31) or there are no values."""
    values = torch.as_tensor(values, dtype=torch.float64).flatten()
    returns = torch.as_tensor(returns, dtype=torch.float64).flatten()
    if returns.numel() == 0:
        return math.nan
    return explained_from_moments(float((returns - values).var(unbiased=False)), float(returns.var(unbiased=False)),
                                  float(returns.square().mean()))


def explained_from_moments(error_variance: float, return_variance: float, return_mean_square: float) -> float:
    """1 - Var(R - V) / Var(R) from the variances, NaN where the returns do not vary beyond rounding (Var(R) at
    most 1e-12 E[R^2])."""
    if return_variance <= 1e-12 * return_mean_square:
        return math.nan
    return 1.0 - error_variance / return_variance


def sampled_entries(per_token: PerToken, masks: Masks) -> list[float]:
    """The entries at mask-1 positions (the sampled tokens: the steps), in order over the lists."""
    if [len(row) for row in per_token] != [len(mask) for mask in masks]:
        raise ValueError("per-token values and masks differ in shape")
    return [value for row, mask in zip(per_token, masks) for value, m in zip(row, mask) if m]


def _step_rewards(masks: Masks, reward: float, token_rewards: PerToken | None) -> list[float]:
    """Each step's reward: its token reward (0 without), plus `reward` on the last step."""
    zeros = [[0.0] * len(mask) for mask in masks]
    rewards = sampled_entries(token_rewards if token_rewards is not None else zeros, masks)
    if rewards:
        rewards[-1] += reward
    return rewards


def _scatter(steps: Sequence[float], masks: Masks) -> list[list[float]]:
    """`steps` (one per mask-1 position, in order) put back in the masks' shape, 0.0 at the masked positions."""
    values = iter(steps)
    return [[next(values) if m else 0.0 for m in mask] for mask in masks]
