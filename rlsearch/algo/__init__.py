"""RL math as pure functions: advantages (GRPO, RLOO, REINFORCE++-baseline per trajectory; per turn from turn
rewards; GAE and REINFORCE++'s reward-to-go per token, carried across tool outputs and folded segments), policy losses
(PPO-clip, GSPO, CISPO, MiniRL), the critic's value loss, KL estimators, rollout corrections (truncated and masked
importance sampling), loss aggregation, the training objectives the actor and the critic run, group filtering and
mini-batch bounds."""

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
from .loss import (
    PolicyLossTerms,
    ValueLossTerms,
    cispo_terms,
    gspo_terms,
    kl_estimate,
    loss_token_weights,
    minirl_terms,
    ppo_clip_terms,
    truncated_importance_weights,
    value_loss_terms,
)
from .objectives import (
    POLICY_LOSSES,
    GRPOSettings,
    Objective,
    ObjectiveBatch,
    ValueBatch,
    ValueSettings,
    critic_objective,
    grpo_objective,
    policy_loss_terms,
    ratio_base,
    sft_objective,
    value_metrics,
)
from .returns import explained_variance, gae, reward_to_go, sampled_entries, trajectory_gae, whiten

__all__ = [
    "LOG_RATIO_BINS", "POLICY_LOSSES", "ROLLOUT_CORRECTIONS", "SEQUENCE_CORRECTIONS", "GRPOSettings", "Objective",
    "ObjectiveBatch", "PolicyLossTerms", "RolloutCorrection", "ValueBatch", "ValueLossTerms", "ValueSettings",
    "cispo_terms", "critic_objective", "discounted_returns", "explained_variance", "gae", "gigpo_advantages",
    "group_mean_baseline", "grpo_advantages", "grpo_objective", "groups_with_signal", "gspo_terms",
    "histogram_quantile", "kl_estimate", "log_ratio_histogram", "loss_token_weights", "minibatch_bounds",
    "minirl_terms", "policy_loss_terms", "ppo_clip_terms", "ratio_base", "reward_to_go", "rloo_advantages",
    "rollout_correction", "sampled_entries", "sft_objective", "trajectory_gae", "truncated_importance_weights",
    "turn_return_advantages", "value_loss_terms", "value_metrics", "whiten",
]
