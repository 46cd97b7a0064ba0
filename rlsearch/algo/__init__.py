"""RL math as pure functions: GRPO advantages, PPO-clip policy loss, KL estimators, loss aggregation."""

from .advantages import grpo_advantages
from .loss import PolicyLossTerms, kl_estimate, loss_token_weights, ppo_clip_terms

__all__ = ["PolicyLossTerms", "grpo_advantages", "kl_estimate", "loss_token_weights", "ppo_clip_terms"]
