"""RL math as pure functions: advantages (GRPO, RLOO, REINFORCE++-baseline per trajectory; per turn from turn
rewards; GAE and REINFORCE++'s reward-to-go per token, carried across tool outputs and folded segments), PPO-clip
policy loss, KL estimators, rollout corrections (truncated and masked importance sampling), loss aggregation, the
training objectives the actor runs, group filtering and mini-batch bounds."""

from .advantages import (
    discounted_returns,
    gigpo_advantages,
    group_mean_baseline,
    grpo_advantages,
    rloo_advantages,
    turn_return_advantages,
)
from .batching import groups_with_signal, minibatch_bounds
from .correction import (
    LOG_RATIO_BINS,
    ROLLOUT_CORRECTIONS,
    SEQUENCE_CORRECTIONS,
    RolloutCorrection,
    histogram_quantile,
    log_ratio_histogram,
    rollout_correction,
)
from .loss import PolicyLossTerms, kl_estimate, loss_token_weights, ppo_clip_terms, truncated_importance_weights
from .objectives import GRPOSettings, Objective, ObjectiveBatch, grpo_objective, sft_objective
from .returns import explained_variance, gae, reward_to_go, trajectory_gae, whiten

__all__ = [
    "LOG_RATIO_BINS", "ROLLOUT_CORRECTIONS", "SEQUENCE_CORRECTIONS", "GRPOSettings", "Objective", "ObjectiveBatch",
    "PolicyLossTerms", "RolloutCorrection", "discounted_returns", "explained_variance", "gae", "gigpo_advantages",
    "group_mean_baseline", "grpo_advantages", "grpo_objective", "groups_with_signal", "histogram_quantile",
    "kl_estimate", "log_ratio_histogram", "loss_token_weights", "minibatch_bounds", "ppo_clip_terms",
    "reward_to_go", "rloo_advantages", "rollout_correction", "sft_objective", "trajectory_gae",
    "truncated_importance_weights", "turn_return_advantages", "whiten",
]
