"""RL math as pure functions: GRPO advantages (per trajectory, and per turn from turn rewards), PPO-clip policy loss,
KL estimators, rollout corrections (truncated and masked importance sampling), loss aggregation, the training
objectives the actor runs, group filtering and mini-batch bounds."""

from .advantages import discounted_returns, gigpo_advantages, grpo_advantages, turn_return_advantages
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

__all__ = [
    "LOG_RATIO_BINS", "ROLLOUT_CORRECTIONS", "SEQUENCE_CORRECTIONS", "GRPOSettings", "Objective", "ObjectiveBatch",
    "PolicyLossTerms", "RolloutCorrection", "discounted_returns", "gigpo_advantages", "grpo_advantages",
    "grpo_objective", "groups_with_signal", "histogram_quantile", "kl_estimate", "log_ratio_histogram",
    "loss_token_weights", "minibatch_bounds", "ppo_clip_terms", "rollout_correction", "sft_objective",
    "truncated_importance_weights", "turn_return_advantages",
]
