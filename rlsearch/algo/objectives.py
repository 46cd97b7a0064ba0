"""Training objectives: per-micro-batch loss and stats from the policy's logprobs, or from the critic's values. Pure
tensor math.

The actor calls the objective it is given with the logprobs of the micro-batch's selected positions and the
micro-batch: any object with the fields of `ObjectiveBatch` (the actor's MicroBatch is one). It returns the
aggregated loss (token weights applied: summed over every micro-batch of a step it is the step's loss) and sums that
the actor group reduces. The critic's objective is the same with values for logprobs (`ValueBatch`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

import torch

from .correction import log_ratio_histogram, rollout_correction
from .loss import (
    PolicyLossTerms,
    cispo_terms,
    gspo_terms,
    kl_estimate,
    minirl_terms,
    ppo_clip_terms,
    value_loss_terms,
)
from .returns import explained_from_moments

POLICY_LOSSES = ("ppo_clip", "gspo", "cispo", "minirl")


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

    policy_loss: str
    ratio_against: str
    clip_ratio_low: float
    clip_ratio_high: float
    gspo_clip_low: float
    gspo_clip_high: float
    kl_coef: float
    kl_estimator: str
    kl_penalty: str
    rollout_correction: str
    tis_cap: float
    mis_low: float
    mis_high: float
    icepop_low: float
    icepop_high: float


class Objective(Protocol):
    def __call__(
        self, logprobs: torch.Tensor, batch: ObjectiveBatch
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ...


def grpo_objective(
    logprobs: torch.Tensor, batch: ObjectiveBatch, algo: GRPOSettings
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss algo.policy_loss (`policy_loss_terms`) with the samples' advantages, + KL to the reference
    when algo.kl_coef > 0 and algo.kl_penalty is loss (with reward the penalty is in the advantages' returns).

    The ratio r is against `ratio_base`: the actor's old logprobs (algo.ratio_against old: the policy before the
    step's first update, or the current one when there are none, a single update per step giving r = 1), or the
    engine's (rollout). The rollout correction (algo.rollout_correction, `rlsearch.algo.correction`) accounts for the
    engine having sampled with other weights or numerics, from pi_base / pi_rollout, the policy the ratio starts
    from, so a token's policy change is not counted twice: by default truncated importance weights min(., tis_cap)
    per token; against the rollout that ratio is 1 and the correction leaves the tokens as they are.
    """
    base = ratio_base(logprobs, batch, algo)
    terms = policy_loss_terms(logprobs, base, batch, algo)
    mask, weights = batch.loss_mask, batch.token_weights
    correction = rollout_correction(base, batch, algo)
    policy_per_token = terms.per_token_loss * correction.weights
    kl = torch.zeros_like(logprobs)
    if algo.kl_coef > 0 and algo.kl_penalty == "loss":
        kl = kl_estimate(logprobs, batch.ref_logprobs, algo.kl_estimator)
    loss = ((policy_per_token + algo.kl_coef * kl) * weights).sum()
    # log of pi_old / pi_rollout of the trained tokens with rollout logprobs (none when tool output trains too: it was
    # never sampled), the actor's old policy whatever the ratio's base: the engine-vs-actor mismatch
    log_ratio, measured = torch.zeros_like(kl), torch.zeros_like(mask)
    if batch.rollout_logprobs is not None:
        log_ratio, measured = _actor_old_logprobs(logprobs, batch) - batch.rollout_logprobs, mask
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


def ratio_base(logprobs: torch.Tensor, batch: ObjectiveBatch, algo: GRPOSettings) -> torch.Tensor:
    """The logprobs the policy ratio r = pi / pi_base starts from, per algo.ratio_against: old (the actor's old
    logprobs, or the current ones detached when there are none) or rollout (the engine's: MiniRL's and AReaL's
    decoupled form, where r carries the engine's numerics and staleness)."""
    if algo.ratio_against == "old":
        return _actor_old_logprobs(logprobs, batch)
    if algo.ratio_against == "rollout":
        if batch.rollout_logprobs is None:
            raise ValueError("algo.ratio_against=rollout needs the engine's logprobs of every trained token (tool "
                             "output trained with algo.mask_observations=false has none)")
        return batch.rollout_logprobs
    raise ValueError(f"unknown algo.ratio_against {algo.ratio_against!r} (expected old or rollout)")


def policy_loss_terms(
    logprobs: torch.Tensor, base: torch.Tensor, batch: ObjectiveBatch, algo: GRPOSettings
) -> PolicyLossTerms:
    """The per-token terms of algo.policy_loss (`POLICY_LOSSES`), r = pi / pi_base: ppo_clip and minirl clip r to
    [1 - clip_ratio_low, 1 + clip_ratio_high], cispo weighs by min(r, 1 + clip_ratio_high), gspo clips each
    sequence's ratio to [1 - gspo_clip_low, 1 + gspo_clip_high] (`rlsearch.algo.loss`)."""
    advantages = batch.advantages
    if algo.policy_loss == "ppo_clip":
        return ppo_clip_terms(logprobs, base, advantages, algo.clip_ratio_low, algo.clip_ratio_high)
    if algo.policy_loss == "gspo":
        return gspo_terms(logprobs, base, advantages, batch.loss_mask, batch.response_lens, algo.gspo_clip_low,
                          algo.gspo_clip_high)
    if algo.policy_loss == "cispo":
        return cispo_terms(logprobs, base, advantages, algo.clip_ratio_high)
    if algo.policy_loss == "minirl":
        return minirl_terms(logprobs, base, advantages, algo.clip_ratio_low, algo.clip_ratio_high)
    raise ValueError(f"unknown algo.policy_loss {algo.policy_loss!r} (expected one of {', '.join(POLICY_LOSSES)})")


def _actor_old_logprobs(logprobs: torch.Tensor, batch: ObjectiveBatch) -> torch.Tensor:
    """The actor's logprobs before the step's first update; the current ones, detached, when there are none."""
    return batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()


def sft_objective(logprobs: torch.Tensor, batch: ObjectiveBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The negative log-likelihood of the loss-masked tokens (a supervised warm start; logprobs at temperature 1)."""
    nll = -logprobs
    loss = (nll * batch.token_weights).sum()
    stats = {"loss": loss.detach(), "nll_sum": (nll.detach() * batch.loss_mask).sum(), "tokens": batch.loss_mask.sum()}
    return loss, stats


class ValueBatch(Protocol):
    """What the critic's objective reads of a micro-batch: 1-D tensors over its selected positions."""

    loss_mask: torch.Tensor
    token_weights: torch.Tensor
    returns: torch.Tensor  # the values' targets (`rlsearch.algo.trajectory_gae`)
    old_values: torch.Tensor  # the critic's values the returns were estimated with


class ValueSettings(Protocol):
    """What the critic's objective reads of the critic config (rlsearch.config.CriticConfig)."""

    value_clip: float


def critic_objective(
    values: torch.Tensor, batch: ValueBatch, settings: ValueSettings
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's clipped value loss (`value_loss_terms`, clip settings.value_clip) of its `values` at the
    batch's positions, aggregated by the token weights. The stats are sums over the trained tokens that add up over
    micro-batches and ranks (`value_metrics` reads them): "loss" and "value_loss" (the weighted loss, the same
    figure), "value_clip_tokens", "tokens", and the moments of V and R - V, in float64 since explained variance
    subtracts them."""
    terms = value_loss_terms(values, batch.old_values, batch.returns, settings.value_clip)
    loss = (terms.per_token_loss * batch.token_weights).sum()
    mask = batch.loss_mask
    mask64, values64, returns64 = mask.double(), values.detach().double(), batch.returns.double()
    errors = returns64 - values64
    stats = {
        "loss": loss.detach(),
        "value_loss": loss.detach(),
        "value_clip_tokens": (terms.clipped * mask).sum(),
        "tokens": mask.sum(),
        "value_sum": (values64 * mask64).sum(),
        "return_sum": (returns64 * mask64).sum(),
        "return_sq_sum": (returns64.square() * mask64).sum(),
        "error_sum": (errors * mask64).sum(),
        "error_sq_sum": (errors.square() * mask64).sum(),
    }
    return loss, stats


def value_metrics(summed: Mapping[str, float]) -> dict[str, float]:
    """The critic's step metrics from `critic_objective`'s stats summed over every micro-batch and rank: the loss,
    the share of tokens whose clipped branch was the larger, explained variance 1 - Var(R - V) / Var(R) (population
    variances from the sums: NaN when the returns do not vary, as `rlsearch.algo.explained_variance`), and the mean
    value and return per trained token."""
    tokens = summed["tokens"]
    per_token = max(tokens, 1.0)
    return_mean = summed["return_sum"] / per_token
    return_variance = summed["return_sq_sum"] / per_token - return_mean**2
    error_variance = summed["error_sq_sum"] / per_token - (summed["error_sum"] / per_token) ** 2
    explained = explained_from_moments(error_variance, return_variance, summed["return_sq_sum"] / per_token) \
        if tokens > 0 else math.nan
    return {
        "critic/value_loss": summed["value_loss"],
        "critic/value_clip_fraction": summed["value_clip_tokens"] / per_token,
        "critic/explained_variance": explained,
        "critic/value_mean": summed["value_sum"] / per_token,
        "critic/return_mean": return_mean,
    }
