"""The step's advantages under algo.advantage, from its trajectories' rewards: one per trajectory (GRPO, RLOO, the
group baseline of REINFORCE++-baseline) when the samples are made, per token (GAE from the critic's values,
REINFORCE++'s reward-to-go, the whitening over the step) once the reference and the critic have scored the samples.
The math is rlsearch.algo's; this module maps it over the step's trajectories and their samples."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from ..algo import (
    explained_variance,
    group_mean_baseline,
    grpo_advantages,
    kl_estimate,
    reward_to_go,
    rloo_advantages,
    sampled_entries,
    trajectory_gae,
    whiten,
)
from ..config import AlgoConfig

if TYPE_CHECKING:
    import torch

    from ..actor import TrainSample
    from ..rollout import Trajectory

PER_TOKEN_ESTIMATORS = ("gae", "reinforce_pp", "reinforce_pp_baseline")  # whose advantages `token_estimates` sets


def trajectory_advantages(trajectories: list[Trajectory], algo: AlgoConfig) -> torch.Tensor:
    """One advantage per trajectory from the rewards of its group: GRPO's (also the outcome term of turn_returns and
    gigpo), RLOO's, or the group-mean baseline REINFORCE++-baseline whitens later; 0 for the estimators whose
    advantages are per token (gae, reinforce_pp)."""
    import torch

    rewards = torch.tensor([t.reward for t in trajectories])
    groups = [t.group_id for t in trajectories]
    if algo.advantage == "rloo":
        return rloo_advantages(rewards, groups)
    if algo.advantage == "reinforce_pp_baseline":
        return group_mean_baseline(rewards, groups)
    if algo.advantage in ("gae", "reinforce_pp"):
        return torch.zeros(len(trajectories))
    return grpo_advantages(rewards, groups, norm_by_std=algo.norm_adv_by_std, eps=algo.adv_eps)


def token_estimates(trajectories: list[Trajectory], samples: list[TrainSample], algo: AlgoConfig,
                    values: list[list[float]] | None = None) -> dict[str, float]:
    """Per-token advantages of `samples` (made by `train_samples` from the non-failed ones of `trajectories`, each
    trajectory's segments in order) under algo.advantage gae (with the critic's `values` per sample; the samples also
    get their value targets and old values), reinforce_pp or reinforce_pp_baseline, whitened over the step's trained
    tokens (gae: with algo.whiten_advantages). Returns the step's algo/* and critic/* figures ({} for the other
    estimators, whose advantages the samples already hold)."""
    if algo.advantage not in PER_TOKEN_ESTIMATORS or not samples:
        return {}
    masks = [sample.loss_mask for sample in samples]
    penalties = _kl_penalties(samples, algo)
    advantages: list[list[float]] = []
    returns: list[list[float]] = []
    start = 0
    for trajectory in (t for t in trajectories if not t.failed):
        end = start + len(trajectory.segments)
        own_masks, own_penalties = masks[start:end], penalties[start:end] if penalties else None
        if algo.advantage == "gae":
            own_advantages, own_returns = trajectory_gae(
                own_masks, values[start:end], trajectory.reward, algo.gamma, algo.lam, algo.value_lam, own_penalties)
            returns += own_returns
        elif algo.advantage == "reinforce_pp":
            own_advantages = reward_to_go(own_masks, trajectory.reward, algo.gamma, own_penalties)
        else:
            own_advantages = [[sample.advantage * m for m in sample.loss_mask] for sample in samples[start:end]]
        advantages += own_advantages
        start = end
    if start != len(samples):
        raise ValueError(f"{len(samples)} samples for the {start} segments of the step's trajectories")
    raw = sampled_entries(advantages, masks)
    if algo.advantage != "gae" or algo.whiten_advantages:
        advantages = whiten(advantages, masks)
    for index, sample in enumerate(samples):
        sample.advantages = advantages[index]
        if algo.advantage == "gae":
            sample.returns, sample.old_values = returns[index], values[index]
    return {**_distribution("algo/advantage_raw", raw), **(_critic_figures(returns, values, masks) if returns else {})}


def _kl_penalties(samples: list[TrainSample], algo: AlgoConfig) -> list[list[float]] | None:
    """-kl_coef x KL(pi_old || ref) per response token (algo.kl_penalty=reward), pi_old the engine's sampled
    distribution (the rollout logprobs); None when the KL is no reward term."""
    import torch

    if algo.kl_coef <= 0 or algo.kl_penalty != "reward":
        return None
    return [(-algo.kl_coef * kl_estimate(torch.tensor(sample.rollout_logprobs), torch.tensor(sample.ref_logprobs),
                                         algo.kl_estimator)).tolist() for sample in samples]


def _distribution(name: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {f"{name}_mean": statistics.fmean(values), f"{name}_std": statistics.pstdev(values),
            f"{name}_min": min(values), f"{name}_max": max(values)}


def _critic_figures(returns: list[list[float]], values: list[list[float]], masks: list[list[int]]
                    ) -> dict[str, float]:
    """How well the critic's values (before this step's update) predicted the step's returns, over trained tokens."""
    trained_values, trained_returns = sampled_entries(values, masks), sampled_entries(returns, masks)
    if not trained_values:
        return {}
    return {
        "critic/explained_variance": explained_variance(trained_values, trained_returns),
        "critic/value_mean": statistics.fmean(trained_values),
        "critic/return_mean": statistics.fmean(trained_returns),
    }
