"""Rollout correction: how the policy gradient accounts for tokens the engine sampled under other weights or numerics
(pi_rollout) than the actor's old policy (pi_old). Pure tensor math over a micro-batch's selected positions.

r = pi_old / pi_rollout per sampled token. Token-level corrections act on each token's r; sequence-level ones on the
product of r over a sequence's trained tokens, one figure per sequence for all its tokens. A "sequence" is one trained
sample: a whole trajectory, or one segment of it when rollout.context folds or drops observations (each segment is a
sample of its own). Three kinds:
- truncated importance sampling (token_tis, seq_tis): weight min(r, cap);
- masked importance sampling (token_mis, seq_mis, icepop): weight r inside a band, 0 outside (token and
  sequence MIS; IcePop, from the Ring-1T report and INTELLECT-3 eq. 1: M(k) = k for k in [alpha, beta]);
- rejection (token_rs, seq_rs; verl's rollout_rs): weight 1 inside the band, 0 outside, r itself unused.
A masked token (weight 0) keeps its place in the loss normaliser.

The ratio's distribution is logged through counts of trained tokens per fixed bin of log r (`LOG_RATIO_EDGES`):
counts add up over micro-batches and ranks, quantiles do not; `histogram_quantile` reads approximate quantiles back.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from .loss import truncated_importance_weights
from .sequences import sequence_index, sequence_sums

ROLLOUT_CORRECTIONS = ("token_tis", "seq_tis", "token_mis", "seq_mis", "icepop", "token_rs", "seq_rs")
SEQUENCE_CORRECTIONS = ("seq_tis", "seq_mis", "seq_rs")
# weighted by r inside their band (masked importance sampling); the other band corrections reject with weight 1
IMPORTANCE_BANDS = ("token_mis", "seq_mis", "icepop")
# bin edges of log(pi_old / pi_rollout): fine near 0, where a healthy run's tokens are (a tiny fp32 model's mean
# |log r| was 4e-7 on CPU, the warm-started one's 6e-5; bf16 engines ~1e-2)
LOG_RATIO_EDGES = (-2.0, -1.0, -0.5, -0.2, -0.1, -0.05, -0.01, -1e-3, -1e-4, -1e-5, -1e-6,
                   1e-6, 1e-5, 1e-4, 1e-3, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
LOG_RATIO_BINS = tuple(f"log_ratio_bin_{index:02d}" for index in range(len(LOG_RATIO_EDGES) + 1))


class CorrectedBatch(Protocol):
    """What a rollout correction reads of a micro-batch (rlsearch.algo.ObjectiveBatch has it)."""

    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor | None
    response_lens: list[int]  # read by sequence-level corrections only


class CorrectionSettings(Protocol):
    """What a rollout correction reads of the algo config (rlsearch.config.AlgoConfig)."""

    rollout_correction: str
    tis_cap: float
    mis_low: float
    mis_high: float
    icepop_low: float
    icepop_high: float


@dataclass
class RolloutCorrection:
    weights: torch.Tensor  # per position, detached: what each token's policy-gradient term is multiplied by
    capped: torch.Tensor  # per position, True where a cap bound the weight (its own or its sequence's)
    masked: torch.Tensor  # per position, True where the token is masked out (outside the band)
    sequences: torch.Tensor  # sequences with a trained token (seq_* only; else 0)
    capped_sequences: torch.Tensor  # of those, whose weight was capped (seq_tis)
    masked_sequences: torch.Tensor  # of those, masked out (seq_mis)


def rollout_correction(old_logprobs: torch.Tensor, batch: CorrectedBatch, settings: CorrectionSettings
                       ) -> RolloutCorrection:
    """The correction `settings.rollout_correction` asks for (`ROLLOUT_CORRECTIONS`) of `batch`'s positions. Weights 1
    when there are no rollout logprobs (tool output trained with algo.mask_observations off) or with token_tis and
    tis_cap 0. Sequence-level corrections sum over each sequence's positions (`batch.response_lens`, in order)."""
    ones = torch.ones_like(old_logprobs)
    none = torch.zeros_like(old_logprobs, dtype=torch.bool)
    zero = batch.loss_mask.new_zeros(())
    mode, cap = settings.rollout_correction, settings.tis_cap
    rollout_logprobs, loss_mask = batch.rollout_logprobs, batch.loss_mask
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout correction {mode!r} (expected one of {', '.join(ROLLOUT_CORRECTIONS)})")
    if rollout_logprobs is None or (mode == "token_tis" and cap <= 0):
        return RolloutCorrection(ones, none, none, zero, zero, zero)
    if mode == "token_tis":
        weights = truncated_importance_weights(old_logprobs, rollout_logprobs, cap)
        return RolloutCorrection(weights, weights >= cap, none, zero, zero, zero)
    log_ratio = old_logprobs.detach() - rollout_logprobs
    importance = mode in IMPORTANCE_BANDS
    if mode not in SEQUENCE_CORRECTIONS:
        low, high = (settings.icepop_low, settings.icepop_high) if mode == "icepop" else (
            settings.mis_low, settings.mis_high)
        kept = inside_band(log_ratio, low, high)
        return RolloutCorrection(_band_weights(log_ratio, kept, importance), none, ~kept, zero, zero, zero)
    lens = batch.response_lens
    sequence = sequence_index(lens, old_logprobs.numel(), old_logprobs.device)
    totals = sequence_sums(log_ratio * loss_mask, sequence, len(lens))
    trained = sequence_sums(loss_mask, sequence, len(lens)) > 0
    if mode == "seq_tis":
        sequence_weights = torch.exp(torch.clamp(totals, max=20.0)).clamp(max=cap)
        capped = sequence_weights >= cap
        return RolloutCorrection(sequence_weights[sequence], capped[sequence], none, _count(trained, zero),
                                 _count(capped & trained, zero), zero)
    kept = inside_band(totals, settings.mis_low, settings.mis_high)
    return RolloutCorrection(_band_weights(totals, kept, importance)[sequence], none, ~kept[sequence],
                             _count(trained, zero), zero, _count(~kept & trained, zero))


def _count(flags: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return flags.sum().to(like.dtype)


def inside_band(log_ratio: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """low <= exp(log_ratio) <= high, compared in log space (no overflow)."""
    return (log_ratio >= math.log(low)) & (log_ratio <= math.log(high))


def _band_weights(log_ratio: torch.Tensor, kept: torch.Tensor, importance: bool) -> torch.Tensor:
    """r where `kept` and 0 elsewhere (masked importance sampling), or 1 and 0 (rejection: r unused)."""
    if not importance:
        return kept.to(log_ratio.dtype)
    return torch.exp(log_ratio.masked_fill(~kept, -math.inf))


def log_ratio_histogram(log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Masked positions per bin of `LOG_RATIO_EDGES` (bin i holds edges[i-1] <= x < edges[i]), keyed by
    `LOG_RATIO_BINS`: sums that add up over micro-batches and ranks."""
    bins = torch.bucketize(log_ratio.detach(), torch.tensor(LOG_RATIO_EDGES, dtype=log_ratio.dtype,
                                                            device=log_ratio.device), right=True)
    counts = mask.new_zeros(len(LOG_RATIO_BINS)).index_add_(0, bins, mask)
    return dict(zip(LOG_RATIO_BINS, counts.unbind()))


def histogram_quantile(counts: Mapping[str, float], q: float) -> float:
    """The `q` quantile (0..1) of log r from `log_ratio_histogram`'s summed counts: interpolated linearly within its
    bin, the outer bins read as their finite edge. 0.0 (r = 1) when no position was counted."""
    values = [counts[key] for key in LOG_RATIO_BINS]
    cumulative = list(itertools.accumulate(values))
    if cumulative[-1] <= 0:
        return 0.0
    target = q * cumulative[-1]
    index = next(i for i, count in enumerate(values) if count > 0 and cumulative[i] >= target)
    low = LOG_RATIO_EDGES[max(index - 1, 0)]
    high = LOG_RATIO_EDGES[min(index, len(LOG_RATIO_EDGES) - 1)]
    return low + (high - low) * (target - cumulative[index] + values[index]) / values[index]
