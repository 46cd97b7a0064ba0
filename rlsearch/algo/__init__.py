"""RL math as pure functions: GRPO advantages, PPO-clip policy loss, KL estimators, truncated importance weights,
loss aggregation."""

from .advantages import grpo_advantages
from .loss import PolicyLossTerms, kl_estimate, loss_token_weights, ppo_clip_terms, truncated_importance_weights

__all__ = [
    "PolicyLossTerms", "grpo_advantages", "kl_estimate", "loss_token_weights", "ppo_clip_terms",
    "truncated_importance_weights",
]
