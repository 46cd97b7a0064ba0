"""The policy losses (algo.policy_loss gspo, cispo, minirl; algo.ratio_against rollout; algo.loss_agg
seq_mean_token_sum) as the Megatron actor trains them: its loss on a packed, off-policy batch equals the
rlsearch.algo objective applied to HF transformers' logprobs of the same samples, on the trained positions the actor
selects, at TP1, and GSPO at TP2 x PP2's four ranks too (its sequence ratio needs each sequence whole on a rank)."""

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
