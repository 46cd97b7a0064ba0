"""Token-level policy loss (PPO-clip), KL estimators and loss aggregation weights. Pure tensor math."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class PolicyLossTerms:
    per_token_loss: torch.Tensor  # what the optimizer minimises, per token (mask not applied)
    ratio: torch.Tensor
    clipped: torch.Tensor  # 1.0 where the clipped branch was active
    approx_kl: torch.Tensor  # k3 estimate of KL(old || new) per token


def ppo_clip_terms(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
) -> PolicyLossTerms:
    """PPO's clipped surrogate per token: max(-A r, -A clip(r, 1-low, 1+high)). Advantages broadcast per token."""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    return PolicyLossTerms(
        per_token_loss=torch.maximum(unclipped, clipped),
        ratio=ratio.detach(),
        clipped=(clipped > unclipped).float().detach(),
        approx_kl=kl_estimate(old_logprobs, logprobs, "k3").detach(),
    )


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
    Weights make the aggregate independent of how the batch is split into micro-batches or DP ranks.
    """
    if mode == "token_mean":
        total = sum(sum(mask) for mask in loss_masks)
        return [[m / total if total else 0.0 for m in mask] for mask in loss_masks]
    if mode == "seq_mean_token_mean":
        trained = [mask for mask in loss_masks if sum(mask)]
        return [
            [m / (sum(mask) * len(trained)) if sum(mask) else 0.0 for m in mask] for mask in loss_masks
        ]
    raise ValueError(f"unknown loss aggregation '{mode}' (expected token_mean or seq_mean_token_mean)")
