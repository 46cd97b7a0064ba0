"""Per-token policy losses (PPO-clip, GSPO, CISPO, MiniRL), the critic's value loss, KL estimators and loss
aggregation weights. Pure tensor math."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .sequences import sequence_index, sequence_sums


@dataclass
class PolicyLossTerms:
    per_token_loss: torch.Tensor  # what the optimizer minimises, per token (mask not applied)
    ratio: torch.Tensor
    clipped: torch.Tensor  # 1.0 where the clipped branch was active
    approx_kl: torch.Tensor  # k3 estimate of KL(old || new) per token


@dataclass
class ValueLossTerms:
    per_token_loss: torch.Tensor  # what the critic's optimizer minimises, per token (mask not applied)
    clipped: torch.Tensor  # 1.0 where the clipped branch was the larger


def ppo_clip_terms(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
) -> PolicyLossTerms:
    """PPO's clipped surrogate per token: max(-A r, -A clip(r, 1-low, 1+high)). Advantages broadcast per token."""
    ratio = torch.exp(logprobs - old_logprobs)
    return _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high, logprobs, old_logprobs)


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float,
                       logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> PolicyLossTerms:
    """max(-A r, -A clip(r, 1 - low, 1 + high)) per token of the ratio `ratio` (a token's or its sequence's), with
    where the clipped branch was the larger and the k3 estimate of KL(old || new)."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    return PolicyLossTerms(
        per_token_loss=torch.maximum(unclipped, clipped),
        ratio=ratio.detach(),
        clipped=(clipped > unclipped).float().detach(),
        approx_kl=kl_estimate(old_logprobs, logprobs, "k3").detach(),
    )


def gspo_terms(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    response_lens: Sequence[int],
    clip_low: float,
    clip_high: float,
) -> PolicyLossTerms:
    """GSPO-token (Zheng et al., 2025, arXiv 2507.18071; verl's compute_policy_loss_gspo): per sequence (laid back to
    back by `response_lens`) the length-normalised ratio s_i = exp(sum_t m_t log r_t / sum_t m_t) over its trained
    tokens; per token s_it = sg(s_i) exp(log pi_t - sg(log pi_t)), whose value is s_i and whose gradient is
    s_i grad log pi_t; loss_t = max(-A s_it, -A clip(s_it, 1 - low, 1 + high)). A clipped sequence's
    tokens are all clipped. The log of s_it is capped at 10 (verl's cap) so that one sequence cannot overflow."""
    sequence = sequence_index(response_lens, logprobs.numel(), logprobs.device)
    num_sequences = len(response_lens)
    trained = sequence_sums(loss_mask.to(logprobs.dtype), sequence, num_sequences).clamp(min=1.0)
    mean_log_ratio = sequence_sums((logprobs - old_logprobs) * loss_mask, sequence, num_sequences) / trained
    log_ratio = torch.clamp(mean_log_ratio.detach()[sequence] + logprobs - logprobs.detach(), max=10.0)
    return _clipped_surrogate(torch.exp(log_ratio), advantages, clip_low, clip_high, logprobs, old_logprobs)


def cispo_terms(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, clip_high: float
) -> PolicyLossTerms:
    """CISPO (MiniMax-M1, arXiv 2506.13585; open-instruct's loss_fn cispo): loss_t = -sg(min(r, 1 + high)) A log pi_t.
    The ratio weighs the token's REINFORCE term instead of gating it: a clipped token (r > 1 + high) keeps its
    gradient, at weight 1 + high. No lower bound."""
    ratio = torch.exp(logprobs.detach() - old_logprobs)
    return PolicyLossTerms(
        per_token_loss=-torch.clamp(ratio, max=1.0 + clip_high) * advantages * logprobs,
        ratio=ratio,
        clipped=(ratio > 1.0 + clip_high).float(),
        approx_kl=kl_estimate(old_logprobs, logprobs, "k3").detach(),
    )


def minirl_terms(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> PolicyLossTerms:
    """MiniRL (Zheng et al., 2025, arXiv 2512.01374; AgentCPM AgentRL's MINIRL with strict_in_bound):
    loss_t = -sg(r) A log pi_t M_t, M_t = 0 where r > 1 + high with A > 0 or r < 1 - low with A < 0, else 1. Its value
    is not PPO-clip's, but its gradient, -r A M grad log pi, is PPO-clip's token for token: clipping written as
    masking. `clipped` marks the masked tokens."""
    ratio = torch.exp(logprobs.detach() - old_logprobs)
    masked = ((ratio > 1.0 + clip_high) & (advantages > 0)) | ((ratio < 1.0 - clip_low) & (advantages < 0))
    return PolicyLossTerms(
        per_token_loss=-ratio * advantages * logprobs * (~masked),
        ratio=ratio,
        clipped=masked.float(),
        approx_kl=kl_estimate(old_logprobs, logprobs, "k3").detach(),
    )


def value_loss_terms(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> ValueLossTerms:
    """PPO's clipped value loss per token: 0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2), V_old the values
    the returns were estimated with; with c = 0 the plain 0.5 (V - R)^2."""
    unclipped = 0.5 * (values - returns).square()
    if clip <= 0:
        return ValueLossTerms(unclipped, torch.zeros_like(unclipped).detach())
    # clamped to the band itself (not old + clamp(V - old)): inside it the clipped branch is V exactly, a tie that
    # rounding must not turn into a clip
    clipped = 0.5 * (torch.clamp(values, old_values - clip, old_values + clip) - returns).square()
    return ValueLossTerms(torch.maximum(unclipped, clipped), (clipped > unclipped).float().detach())


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman's k1/k2/k3).

    k1 = log(pi/ref) (unbiased, can be negative), k2 = 0.5 * log(pi/ref)^2, k3 = ref/pi - 1 - log(ref/pi)
    (unbiased, always >= 0). The log-ratio is clamped to +-20 so that one extreme token cannot produce inf/NaN.
    """
    log_ratio = torch.clamp(logprobs - ref_logprobs, -20.0, 20.0)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise ValueError(f"unknown KL estimator '{estimator}' (expected k1, k2 or k3)")


def truncated_importance_weights(
    logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float
) -> torch.Tensor:
    """Per-token min(pi_actor / pi_rollout, cap), detached: corrects the policy gradient for tokens sampled by the
    rollout engine under other weights (async_steps > 0) or other numerics (bf16 kernels), without letting one
    token's weight explode (truncated importance sampling)."""
    return torch.exp(torch.clamp(logprobs.detach() - rollout_logprobs, max=20.0)).clamp(max=cap)


def loss_token_weights(loss_masks: Sequence[Sequence[int]], mode: str) -> list[list[float]]:
    """Per-token weights such that sum(weight * per_token_loss) over the whole batch is the aggregated loss.

    token_mean: every trained token of the batch counts equally (1 / total trained tokens).
    seq_mean_token_mean: mean over each sequence's trained tokens, then mean over sequences.
    seq_mean_token_sum: sum over each sequence's trained tokens, then mean over the sequences with a trained token
    (1 / those sequences; MiniRL's, and AgentRL's token_level_loss=false with skip_length_normalization=true).
    Weights make the aggregate independent of how the batch is split into micro-batches or DP ranks.
    """
    trained = sum(1 for mask in loss_masks if sum(mask))
    if mode == "token_mean":
        total = sum(sum(mask) for mask in loss_masks)
        return [[m / total if total else 0.0 for m in mask] for mask in loss_masks]
    if mode == "seq_mean_token_mean":
        return [[m / (sum(mask) * trained) if sum(mask) else 0.0 for m in mask] for mask in loss_masks]
    if mode == "seq_mean_token_sum":
        return [[m / trained if trained else 0.0 for m in mask] for mask in loss_masks]
    raise ValueError(
        f"unknown loss aggregation '{mode}' (expected token_mean, seq_mean_token_mean or seq_mean_token_sum)")
