"""Training objectives: per-micro-batch loss and stats from the policy's logprobs. Pure tensor math.

The actor calls the objective it is given with the logprobs of the micro-batch's selected positions and the
micro-batch: any object with the fields of `ObjectiveBatch` (the actor's MicroBatch is one). It returns the
aggregated loss (token weights applied: summed over every micro-batch of a step it is the step's loss) and sums that
the actor group reduces.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .loss import kl_estimate, ppo_clip_terms, truncated_importance_weights


class ObjectiveBatch(Protocol):
    """What an objective reads of a micro-batch: 1-D tensors over its selected positions."""

    loss_mask: torch.Tensor
    token_weights: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    rollout_logprobs: torch.Tensor | None


class GRPOSettings(Protocol):
    """What the GRPO objective reads of the algo config (rlsearch.config.AlgoConfig)."""

    clip_ratio_low: float
    clip_ratio_high: float
    kl_coef: float
    kl_estimator: str
    tis_cap: float


class Objective(Protocol):
    def __call__(
        self, logprobs: torch.Tensor, batch: ObjectiveBatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ...


def grpo_objective(
    logprobs: torch.Tensor, batch: ObjectiveBatch, algo: GRPOSettings
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip with the samples' advantages (+ KL to the reference when algo.kl_coef > 0).

    The ratio is against `batch.old_logprobs` (the policy before the step's first update), or 1 when there are
    none (a single update per step: old policy = current). Truncated importance weights correct for the engine
    having sampled with other weights or numerics: min(pi_old / pi_rollout, tis_cap), the old policy being the
    one the PPO ratio starts from, so a token's policy change is not counted twice.
    """
    old_logprobs = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
    terms = ppo_clip_terms(logprobs, old_logprobs, batch.advantages, algo.clip_ratio_low, algo.clip_ratio_high)
    tis = torch.ones_like(logprobs)
    if algo.tis_cap > 0 and batch.rollout_logprobs is not None:
        tis = truncated_importance_weights(old_logprobs, batch.rollout_logprobs, algo.tis_cap)
    policy_per_token = terms.per_token_loss * tis
    kl = torch.zeros_like(logprobs)
    if algo.kl_coef > 0:
        kl = kl_estimate(logprobs, batch.ref_logprobs, algo.kl_estimator)
    mask, weights = batch.loss_mask, batch.token_weights
    loss = ((policy_per_token + algo.kl_coef * kl) * weights).sum()
    drift = torch.zeros_like(kl)
    if batch.rollout_logprobs is not None:
        drift = (old_logprobs.detach() - batch.rollout_logprobs).abs()
    stats = {
        "loss": loss.detach(),
        "policy_loss": (policy_per_token * weights).sum().detach(),
        "kl_loss": (kl * weights).sum().detach(),
        "clip_tokens": (terms.clipped * mask).sum(),
        "approx_kl_sum": (terms.approx_kl * mask).sum(),
        "rollout_drift_sum": (drift.detach() * mask).sum(),
        "tis_weight_sum": (tis * mask).sum(),
        "tis_capped_tokens": ((tis >= algo.tis_cap) * mask).sum() if algo.tis_cap > 0 else mask.new_zeros(()),
        "tokens": mask.sum(),
    }
    return loss, stats


def sft_objective(logprobs: torch.Tensor, batch: ObjectiveBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The negative log-likelihood of the loss-masked tokens (a supervised warm start; logprobs at temperature 1)."""
    nll = -logprobs
    loss = (nll * batch.token_weights).sum()
    stats = {"loss": loss.detach(), "nll_sum": (nll.detach() * batch.loss_mask).sum(), "tokens": batch.loss_mask.sum()}
    return loss, stats
