"""The policy losses (algo.policy_loss gspo, cispo, minirl; algo.ratio_against rollout; algo.loss_agg
seq_mean_token_sum) as the Megatron actor trains them: its loss on a packed, off-policy batch equals the
rlsearch.algo objective applied to HF transformers' logprobs of the same samples, on the trained positions the actor
selects, at TP1, and GSPO at TP2 x PP2's four ranks too (its sequence ratio needs each sequence whole on a rank).
The masked importance sampling corrections (algo.rollout_correction icepop, seq_mis) on an engine whose logprobs are
off the old policy's by known amounts: the tokens masked and the weights the actor applies."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlsearch.actor.batch import collate
from rlsearch.algo import grpo_objective, loss_token_weights
from rlsearch.config import AlgoConfig
from tests.integration.actor_helpers import actor_spec, hf_logprobs, scored_batch

SETTINGS = {
    "gspo": dict(policy_loss="gspo", gspo_clip_low=1e-3, gspo_clip_high=1e-3, loss_agg="seq_mean_token_mean"),
    "cispo": dict(policy_loss="cispo", clip_ratio_high=0.1),
    "minirl": dict(policy_loss="minirl", clip_ratio_high=0.3, loss_agg="seq_mean_token_sum", ratio_against="rollout"),
}


@pytest.fixture(scope="module")
def batch(tiny_model_dir):
    samples, reference = scored_batch(lambda s: hf_logprobs(tiny_model_dir, s))
    generator = torch.Generator().manual_seed(11)
    for sample, logprobs in zip(samples, reference):  # the engine's logprobs: other numerics than the old policy's
        sample.rollout_logprobs = (logprobs + 0.2 * torch.randn(len(logprobs), generator=generator)).tolist()
    return samples, reference


def expected_loss(samples, reference, algo: AlgoConfig) -> float:
    """rlsearch.algo's objective of the HF logprobs at the positions the actor trains, as one micro-batch."""
    weighted = [dataclasses.replace(s, token_weights=w) for s, w in zip(samples, loss_token_weights(
        [s.loss_mask for s in samples], algo.loss_agg))]
    batch = collate(weighted, list(range(len(samples))), trained_only=True)
    logprobs = torch.cat([ref[torch.tensor(s.loss_mask, dtype=torch.bool)] for s, ref in zip(samples, reference)])
    return grpo_objective(logprobs.float(), batch, algo)[1]["policy_loss"].item()


@pytest.mark.parametrize("loss, layout", [*((loss, (1, 1)) for loss in SETTINGS), ("gspo", (2, 2))],
                         ids=[*(f"{loss}-tp1" for loss in SETTINGS), "gspo-tp2pp2"])
def test_actor_trains_each_policy_loss_as_the_algo_objective(rank_pool, tiny_model_dir, batch, loss, layout):
    samples, reference = batch
    algo = AlgoConfig(**SETTINGS[loss])
    spec = dataclasses.replace(actor_spec(tiny_model_dir, *layout, 1, {}), algo=algo)
    weighted = [dataclasses.replace(s, token_weights=w) for s, w in zip(samples, loss_token_weights(
        [s.loss_mask for s in samples], algo.loss_agg))]
    with rank_pool.group(spec) as group:
        metrics = group.train_step(weighted)
    assert metrics["actor/policy_loss"] == pytest.approx(expected_loss(samples, reference, algo), abs=1e-5)
    assert metrics["actor/clip_fraction"] > 0  # the band acts on this off-policy batch
    assert metrics["actor/grad_norm"] > 0


# log(pi_old / pi_rollout) of each response position in turn: IcePop's [0.5, 5] masks -1 and 2 (log 0.5 = -0.69,
# log 5 = 1.61) and weights the others by e^-0.4, 1, e^0.4, e^1
TOKEN_LOG_RATIOS = (-1.0, -0.4, 0.0, 0.4, 1.0, 2.0)
# per sequence, the sum of log r over its trained tokens: seq_mis's [0.5, 2] masks -1, 1 and -0.8 (|x| > 0.69)
SEQUENCE_LOG_RATIOS = (-1.0, -0.3, 0.0, 0.3, 0.6, 1.0, -0.8, 0.5)


def _token_log_ratios(samples) -> list[torch.Tensor]:
    return [torch.tensor([TOKEN_LOG_RATIOS[i % len(TOKEN_LOG_RATIOS)] for i in range(len(s.loss_mask))])
            for s in samples]


def _sequence_log_ratios(samples) -> list[torch.Tensor]:
    return [torch.full((len(s.loss_mask),), total / sum(s.loss_mask)) for s, total in zip(samples, SEQUENCE_LOG_RATIOS)]


# 312 trained tokens, 8 sequences (scored_batch). icepop masks 2 of every 6 positions: 104 tokens, the others' mean
# weight (e^-0.4 + 1 + e^0.4 + e^1) x 52 / 312 = 0.98007. seq_mis masks sequences 0, 5 and 6 (24 + 54 + 60 response
# tokens, less 6 observation tokens each: 120) and weights the others' tokens by e^(their sequence's sum): 0.87124
@pytest.mark.parametrize("correction, log_ratios, masked_tokens, masked_sequences, weight_mean", [
    ("icepop", _token_log_ratios, 104 / 312, 0.0, 0.9800711),
    ("seq_mis", _sequence_log_ratios, 120 / 312, 3 / 8, 0.8712398),
], ids=["icepop", "seq_mis"])
def test_actor_weights_and_masks_by_the_engines_ratio(rank_pool, tiny_model_dir, batch, correction, log_ratios,
                                                       masked_tokens, masked_sequences, weight_mean):
    samples, reference = batch
    algo = AlgoConfig(rollout_correction=correction)
    engine = [dataclasses.replace(s, rollout_logprobs=(torch.tensor(s.old_logprobs) - offsets).tolist())
              for s, offsets in zip(samples, log_ratios(samples))]
    spec = dataclasses.replace(actor_spec(tiny_model_dir, 1, 1, 1, {}), algo=algo)
    with rank_pool.group(spec) as group:
        metrics = group.train_step(engine)
    assert metrics["actor/correction_masked_fraction"] == pytest.approx(masked_tokens, abs=1e-6)
    assert metrics["actor/seq_masked_fraction"] == pytest.approx(masked_sequences, abs=1e-6)
    assert metrics["actor/tis_weight_mean"] == pytest.approx(weight_mean, abs=1e-6)
    assert metrics["actor/policy_loss"] == pytest.approx(expected_loss(engine, reference, algo), abs=1e-5)
