"""RL math as pure functions: GRPO advantages, PPO-clip policy loss, KL estimators, truncated importance weights,
loss aggregation, the training objectives the actor runs, group filtering and mini-batch bounds."""

from .advantages import grpo_advantages
from .batching import groups_with_signal, minibatch_bounds
from .loss import PolicyLossTerms, kl_estimate, loss_token_weights, ppo_clip_terms, truncated_importance_weights
from .objectives import GRPOSettings, Objective, ObjectiveBatch, grpo_objective, sft_objective

__all__ = [
    "GRPOSettings", "Objective", "ObjectiveBatch", "PolicyLossTerms", "grpo_advantages", "grpo_objective",
    "groups_with_signal", "kl_estimate", "loss_token_weights", "minibatch_bounds", "ppo_clip_terms", "sft_objective",
    "truncated_importance_weights",
]
