"""The rollout corrections of algo.rollout_correction: weights, masks, the GRPO loss and its gradient on a small batch
worked out by hand, the ratio histogram and its quantiles, and what the actor group makes of the summed stats."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rlsearch.algo import (
    LOG_RATIO_BINS,
    ROLLOUT_CORRECTIONS,
    grpo_objective,
    histogram_quantile,
    log_ratio_histogram,
    rollout_correction,
    truncated_importance_weights,
)
from rlsearch.config import AlgoConfig

# Two sequences: the first of three positions (the middle one an observation token: loss mask 0, no rollout logprob,
# log r = -3 that no sequence sum may count), the second of two. log r = log pi_old - log pi_rollout of the trained
# tokens: 0.375, -0.125 (sum 0.25) and 0.75, 0.0625 (sum 0.8125); dyadic, so exact in fp32. Advantages 1 then -1,
# token weights 1/4 on the four trained tokens. On-policy: pi_old is the current policy (PPO ratio 1, whose
# per-token loss is -A and whose gradient is -A per unit weight).
OLD = [-1.0, -3.0, -2.0, -0.5, -1.5]
ROLLOUT = [-1.375, 0.0, -1.875, -1.25, -1.5625]
LOG_R = [0.375, -0.125, 0.75, 0.0625]  # the trained tokens'
R = [math.exp(value) for value in LOG_R]


def _batch(**overrides) -> SimpleNamespace:
    fields = dict(
        loss_mask=torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0]), token_weights=torch.tensor([0.25, 0.0, 0.25, 0.25, 0.25]),
        advantages=torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0]), old_logprobs=None, ref_logprobs=None,
        rollout_logprobs=torch.tensor(ROLLOUT), response_lens=[3, 2],
    )
    return SimpleNamespace(**{**fields, **overrides})


def _objective(**algo) -> tuple[float, list[float], dict[str, float]]:
    """(loss, its gradient per position, stats) of the GRPO objective on the batch above."""
    logprobs = torch.tensor(OLD, requires_grad=True)
    loss, stats = grpo_objective(logprobs, _batch(), AlgoConfig(**algo))
    loss.backward()
    return loss.item(), logprobs.grad.tolist(), {key: value.item() for key, value in stats.items()}


def test_token_tis_weights_each_token_by_its_ratio_capped():
    loss, grad, stats = _objective(rollout_correction="token_tis", tis_cap=1.5)
    weights = [R[0], R[1], 1.5, R[3]]  # e^0.75 = 2.117 is capped
    assert loss == pytest.approx(0.25 * (-weights[0] - weights[1] + weights[2] + weights[3]), abs=1e-6)
    assert loss == pytest.approx(0.0567516, abs=1e-6)
    assert grad == pytest.approx([-0.25 * weights[0], 0.0, -0.25 * weights[1], 0.25 * 1.5, 0.25 * weights[3]],
                                 abs=1e-6)
    assert stats["tis_weight_sum"] == pytest.approx(sum(weights), abs=1e-6)
    assert stats["tis_capped_tokens"] == 1.0 and stats["correction_masked_tokens"] == 0.0
    assert stats["sequences"] == 0.0  # a token-level correction counts no sequences


def test_the_default_is_token_tis_with_the_same_operations_as_before():
    old, rollout = torch.tensor(OLD), torch.tensor(ROLLOUT)
    correction = rollout_correction(old, _batch(), AlgoConfig())
    assert AlgoConfig().rollout_correction == "token_tis"
    assert torch.equal(correction.weights, truncated_importance_weights(old, rollout, 2.0))
    off = rollout_correction(old, _batch(), AlgoConfig(tis_cap=0.0))
    assert torch.equal(off.weights, torch.ones(5)) and not off.capped.any()


def test_seq_tis_weights_every_token_by_its_sequences_capped_product():
    loss, grad, stats = _objective(rollout_correction="seq_tis", tis_cap=2.0)
    first = math.exp(0.25)  # the observation token's log r of -3 is not part of the product
    assert loss == pytest.approx(0.25 * (-2 * first + 2 * 2.0), abs=1e-6)  # e^0.8125 = 2.25 is capped at 2
    assert loss == pytest.approx(0.3579873, abs=1e-6)
    assert grad == pytest.approx([-0.25 * first, 0.0, -0.25 * first, 0.5, 0.5], abs=1e-6)
    assert stats["sequences"] == 2.0 and stats["capped_sequences"] == 1.0 and stats["masked_sequences"] == 0.0
    assert stats["tis_capped_tokens"] == 2.0  # the capped sequence's two tokens


def test_token_mis_weights_the_tokens_inside_the_band_by_their_ratio_and_masks_the_others():
    loss, grad, stats = _objective(rollout_correction="token_mis", mis_low=0.5, mis_high=2.0)
    # r = e^0.75 = 2.117 lies above 2: that token trains no more; the others are weighted by their own r
    assert loss == pytest.approx(0.25 * (-R[0] - R[1] + 0 + R[3]), abs=1e-6)
    assert loss == pytest.approx(-0.3182485, abs=1e-6)
    assert grad == pytest.approx([-0.25 * R[0], 0.0, -0.25 * R[1], 0.0, 0.25 * R[3]], abs=1e-6)
    assert stats["correction_masked_tokens"] == 1.0
    assert stats["tis_weight_sum"] == pytest.approx(R[0] + R[1] + R[3], abs=1e-6)
    assert stats["tis_weight_sum"] == pytest.approx(3.4019828, abs=1e-6)
    assert stats["tis_capped_tokens"] == 0.0


def test_icepop_weights_the_tokens_inside_its_band_by_their_ratio_and_masks_the_others():
    loss, grad, stats = _objective(rollout_correction="icepop", icepop_low=0.9, icepop_high=2.0)
    # [0.9, 2] keeps e^0.375 = 1.455 and e^0.0625 = 1.065 (weighted by them), masks e^-0.125 = 0.882 and e^0.75 = 2.117
    assert loss == pytest.approx(0.25 * (-R[0] + R[3]), abs=1e-6)
    assert loss == pytest.approx(-0.0976242, abs=1e-6)
    assert grad == pytest.approx([-0.25 * R[0], 0.0, 0.0, 0.0, 0.25 * R[3]], abs=1e-6)
    assert stats["correction_masked_tokens"] == 2.0
    assert stats["tis_weight_sum"] == pytest.approx(R[0] + R[3], abs=1e-6)


def test_icepops_default_band_is_the_papers_half_to_five():
    assert (AlgoConfig().icepop_low, AlgoConfig().icepop_high) == (0.5, 5.0)
    loss, grad, stats = _objective(rollout_correction="icepop")
    # every ratio lies in [0.5, 5], e^0.75 = 2.117 too (a band of [1/2, 2] would have masked it): weighted by r
    assert loss == pytest.approx(0.25 * (-R[0] - R[1] + R[2] + R[3]), abs=1e-6)
    assert grad == pytest.approx([-0.25 * R[0], 0.0, -0.25 * R[1], 0.25 * R[2], 0.25 * R[3]], abs=1e-6)
    assert stats["correction_masked_tokens"] == 0.0
    assert stats["tis_weight_sum"] == pytest.approx(5.5189828, abs=1e-6)


def test_seq_mis_weights_the_sequences_inside_the_band_by_their_product_and_masks_the_others():
    loss, grad, stats = _objective(rollout_correction="seq_mis", mis_low=0.5, mis_high=2.0)
    # e^0.25 = 1.284 is kept and weights both its tokens, e^0.8125 = 2.25 masks the second sequence whole
    first = math.exp(0.25)
    assert loss == pytest.approx(0.25 * (-2 * first), abs=1e-6)
    assert loss == pytest.approx(-0.6420127, abs=1e-6)
    assert grad == pytest.approx([-0.25 * first, 0.0, -0.25 * first, 0.0, 0.0], abs=1e-6)
    assert stats["sequences"] == 2.0 and stats["masked_sequences"] == 1.0
    assert stats["correction_masked_tokens"] == 2.0
    assert stats["tis_weight_sum"] == pytest.approx(2 * first, abs=1e-6)


def test_token_rs_rejects_the_tokens_outside_the_band_and_keeps_the_others_with_weight_one():
    loss, grad, stats = _objective(rollout_correction="token_rs", mis_low=0.5, mis_high=2.0)
    # r = e^0.75 = 2.117 lies above 2: that token trains no more; the others keep weight 1
    assert loss == pytest.approx(0.25 * (-1 - 1 + 0 + 1), abs=1e-6)
    assert grad == pytest.approx([-0.25, 0.0, -0.25, 0.0, 0.25], abs=1e-6)
    assert stats["correction_masked_tokens"] == 1.0 and stats["tis_weight_sum"] == 3.0
    assert stats["tis_capped_tokens"] == 0.0


def test_seq_rs_rejects_the_sequences_whose_product_is_outside_the_band():
    loss, grad, stats = _objective(rollout_correction="seq_rs", mis_low=0.5, mis_high=2.0)
    # e^0.25 = 1.28 is kept with weight 1, e^0.8125 = 2.25 masks the second sequence whole
    assert loss == pytest.approx(-0.5, abs=1e-6)
    assert grad == pytest.approx([-0.25, 0.0, -0.25, 0.0, 0.0], abs=1e-6)
    assert stats["sequences"] == 2.0 and stats["masked_sequences"] == 1.0
    assert stats["correction_masked_tokens"] == 2.0 and stats["tis_weight_sum"] == 2.0


def test_corrections_use_the_old_policy_not_the_current_one():
    # the current policy is e^1 above the old one on the last token: pi / pi_rollout = e^1.0625 would be masked by a
    # band of [0.5, 2], pi_old / pi_rollout = e^0.0625 is not; only e^0.75 is masked
    old = torch.tensor(OLD)
    current = old + torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0])
    batch = _batch(old_logprobs=old)
    _, stats = grpo_objective(current, batch, AlgoConfig(rollout_correction="token_mis", clip_ratio_high=100.0))
    assert stats["correction_masked_tokens"] == 1.0
    assert stats["tis_weight_sum"].item() == pytest.approx(R[0] + R[1] + R[3], abs=1e-6)  # e^0.0625, not e^1.0625


def test_no_rollout_logprobs_means_no_correction():
    for mode in ROLLOUT_CORRECTIONS:
        correction = rollout_correction(torch.tensor(OLD), _batch(rollout_logprobs=None),
                                        AlgoConfig(rollout_correction=mode))
        assert torch.equal(correction.weights, torch.ones(5)) and not correction.masked.any(), mode


def test_sequence_corrections_refuse_a_micro_batch_with_part_of_a_sequence():
    with pytest.raises(ValueError, match="every position of a sequence in one micro-batch"):
        rollout_correction(torch.tensor(OLD), _batch(response_lens=[3, 3]), AlgoConfig(rollout_correction="seq_mis"))


def test_log_ratio_histogram_counts_trained_tokens_per_bin():
    log_ratio = torch.tensor(OLD) - torch.tensor(ROLLOUT)
    counts = {key: value.item() for key, value in log_ratio_histogram(log_ratio, _batch().loss_mask).items()}
    assert list(counts) == list(LOG_RATIO_BINS)
    # -0.125 in [-0.2, -0.1) is bin 4, 0.0625 in [0.05, 0.1) bin 17, 0.375 in [0.2, 0.5) bin 19, 0.75 in [0.5, 1) 20
    assert {key: count for key, count in counts.items() if count} == {
        "log_ratio_bin_04": 1.0, "log_ratio_bin_17": 1.0, "log_ratio_bin_19": 1.0, "log_ratio_bin_20": 1.0}
    # the median's target is 2 of 4 tokens: the top of bin 17 (0.1); 1% is 0.04 into bin 4, 99% 0.96 into bin 20
    assert histogram_quantile(counts, 0.5) == pytest.approx(0.1, abs=1e-9)
    assert histogram_quantile(counts, 0.01) == pytest.approx(-0.2 + 0.1 * 0.04, abs=1e-9)
    assert histogram_quantile(counts, 0.99) == pytest.approx(0.5 + 0.5 * 0.96, abs=1e-9)
    outer = dict.fromkeys(LOG_RATIO_BINS, 0.0) | {"log_ratio_bin_00": 3.0, "log_ratio_bin_22": 1.0}
    assert histogram_quantile(outer, 0.5) == -2.0 and histogram_quantile(outer, 0.99) == 2.0  # the finite edges
    assert histogram_quantile(dict.fromkeys(LOG_RATIO_BINS, 0.0), 0.5) == 0.0  # nothing counted: r = 1


def test_the_objectives_histogram_leaves_out_untrained_and_unsampled_tokens():
    _, _, stats = _objective()
    assert sum(stats[key] for key in LOG_RATIO_BINS) == 4.0  # not the observation token
    logprobs = torch.tensor(OLD)
    _, stats = grpo_objective(logprobs, _batch(rollout_logprobs=None), AlgoConfig())
    assert sum(stats[key].item() for key in LOG_RATIO_BINS) == 0.0  # tool output trained too: nothing sampled


def test_the_config_offers_the_corrections_algo_implements():
    from rlsearch.config.validate import _CHOICES

    assert _CHOICES["algo.rollout_correction"] == ROLLOUT_CORRECTIONS
