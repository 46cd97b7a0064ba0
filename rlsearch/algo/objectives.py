"""Training objectives: per-micro-batch loss and stats from the policy's logprobs. Pure tensor math.

The actor calls the objective it is given with the logprobs of the micro-batch's selected positions and the
micro-batch: any object with the fields of `ObjectiveBatch` (the actor's MicroBatch is one). It returns the
aggregated loss (token weights applied: summed over every micro-batch of a step it is the step's loss) and sums that
the actor group reduces.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .correction import log_ratio_histogram, rollout_correction
from .loss import kl_estimate, ppo_clip_terms


class ObjectiveBatch(Protocol):
    """What an objective reads of a micro-batch: 1-D tensors over its selected positions."""

    loss_mask: torch.Tensor
    token_weights: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    rollout_logprobs: torch.Tensor | None
    response_lens: list[int]  # positions per sequence, in order (read by sequence-level rollout corrections)


class GRPOSettings(Protocol):
    """What the GRPO objective reads of the algo config (rlsearch.config.AlgoConfig)."""

    clip_ratio_low: float
    clip_ratio_high: float
    kl_coef: float
    kl_estimator: str
    rollout_correction: str
    tis_cap: float
    mis_low: float
    mis_high: float
    icepop_beta: float


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
    none (a single update per step: old policy = current). The rollout correction (algo.rollout_correction,
    `rlsearch.algo.correction`) accounts for the engine having sampled with other weights or numerics, from
    r = pi_old / pi_rollout, the old policy being the one the PPO ratio starts from, so a token's policy change is not
    counted twice: by default truncated importance weights min(r, tis_cap) per token.
    """
    old_logprobs = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
    terms = ppo_clip_terms(logprobs, old_logprobs, batch.advantages, algo.clip_ratio_low, algo.clip_ratio_high)
    mask, weights = batch.loss_mask, batch.token_weights
    correction = rollout_correction(old_logprobs, batch, algo)
    policy_per_token = terms.per_token_loss * correction.weights
    kl = torch.zeros_like(logprobs)
    if algo.kl_coef > 0:
        kl = kl_estimate(logprobs, batch.ref_logprobs, algo.kl_estimator)
    loss = ((policy_per_token + algo.kl_coef * kl) * weights).sum()
    # log r of the trained tokens with rollout logprobs (none when tool output trains too: it was never sampled)
    log_ratio, measured = torch.zeros_like(kl), torch.zeros_like(mask)
    if batch.rollout_logprobs is not None:
        log_ratio, measured = old_logprobs.detach() - batch.rollout_logprobs, mask
    drift = log_ratio.abs()
    stats = {
        "loss": loss.detach(),
        "policy_loss": (policy_per_token * weights).sum().detach(),
        "kl_loss": (kl * weights).sum().detach(),
        "clip_tokens": (terms.clipped * mask).sum(),
        "approx_kl_sum": (terms.approx_kl * mask).sum(),
        "rollout_drift_sum": (drift.detach() * mask).sum(),
        "tis_weight_sum": (correction.weights * mask).sum(),
        "tis_capped_tokens": (correction.capped * mask).sum(),
        "correction_masked_tokens": (correction.masked * mask).sum(),
        "sequences": correction.sequences,
        "capped_sequences": correction.capped_sequences,
        "masked_sequences": correction.masked_sequences,
        **log_ratio_histogram(log_ratio, measured),
        "tokens": mask.sum(),
    }
    return loss, stats


def sft_objective(logprobs: torch.Tensor, batch: ObjectiveBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The negative log-likelihood of the loss-masked tokens (a supervised warm start; logprobs at temperature 1)."""
    nll = -logprobs
    loss = (nll * batch.token_weights).sum()
    stats = {"loss": loss.detach(), "nll_sum": (nll.detach() * batch.loss_mask).sum(), "tokens": batch.loss_mask.sum()}
    return loss, stats
