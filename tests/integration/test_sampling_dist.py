"""The distribution actually sampled, on both sides: the engine reports each sampled token's logprob under the
distribution it was drawn from, log_softmax((logits + logit_bias) / temperature), and the actor scores it under that
same distribution. Checked after a sync (the session actor's weights loaded into a real engine) on trajectories of
the built-in loop (TEST_ROLLOUT's logit bias on the tool path), at three temperatures."""

from __future__ import annotations

import pytest
import torch

from rlsearch.actor import MODEL_DISTRIBUTION, SamplingDistribution, TrainSample
from rlsearch.algo import truncated_importance_weights
from tests.integration.engine_bench import prompt_items

GAP_TOLERANCE = 1e-4  # fp32: mean |actor - engine| logprob over the sampled tokens
TIS_TOLERANCE = 1e-3  # |mean truncated importance weight - 1|
TIS_CAP = 2.0  # algo.tis_cap's default


@pytest.fixture(scope="module")
def synced_bench(engine_bench, actor_ranks):
    """The engine with the actor's current weights (earlier tests may have trained the session's actor)."""
    engine_bench.load_weights(actor_ranks.hf_state_dict())
    return engine_bench


def gap_and_tis(trajectories, actor_logprobs) -> tuple[float, float]:
    """Over the sampled tokens: the mean |actor - engine| logprob and the mean truncated importance weight."""
    actor = torch.tensor([lp for t, row in zip(trajectories, actor_logprobs)
                          for lp, mask in zip(row, t.loss_mask) if mask], dtype=torch.float64)
    engine = torch.tensor([lp for t in trajectories for lp, mask in zip(t.rollout_logprobs, t.loss_mask) if mask],
                          dtype=torch.float64)
    tis = truncated_importance_weights(actor, engine, TIS_CAP)
    return (actor - engine).abs().mean().item(), tis.mean().item()


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.3])
def test_the_actor_scores_the_distribution_the_engine_sampled_from(synced_bench, actor_ranks, toy_data, temperature):
    loop = synced_bench.loop(temperature=temperature)
    trajectories = synced_bench.events.run(loop.run(prompt_items(toy_data), step=1))
    samples = [TrainSample(t.token_ids, len(t.prompt_ids), t.loss_mask) for t in trajectories]
    assert sum(sum(t.loss_mask) for t in trajectories) > 100

    sampled = SamplingDistribution(temperature, loop.logit_bias)
    gap, tis_mean = gap_and_tis(trajectories, actor_ranks.compute_logprobs(samples, distribution=sampled))
    assert gap <= GAP_TOLERANCE
    assert abs(tis_mean - 1.0) <= TIS_TOLERANCE

    # scoring at another temperature, or the raw model (what vLLM reports by default), is caught
    def gap_under(distribution: SamplingDistribution) -> float:
        return gap_and_tis(trajectories, actor_ranks.compute_logprobs(samples, distribution=distribution))[0]

    assert gap_under(SamplingDistribution(temperature * 1.15, loop.logit_bias)) > 10 * GAP_TOLERANCE
    assert gap_under(MODEL_DISTRIBUTION) > 0.05
