"""Routing replay (algo.routing_replay=old) and the expert-load metrics on a tiny Qwen3-MoE with its experts split
over two ranks: the routing recorded in the old-logprob pass is the routing of every PPO update of the step, even
after an update has moved the router; the moe/* metrics are read back from the same counts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlsearch.config import AlgoConfig
from rlsearch.data.tiny_model import make_tiny_model
from rlsearch.trainer.update import policy_update
from tests.integration.actor_helpers import actor_spec, hf_logprobs, scored_batch
from tests.models import TEST_VOCAB_RANKS, model_spec


def _tokens_per_expert(routing: list[torch.Tensor], num_experts: int) -> torch.Tensor:
    """[layers, experts]: the tokens each expert receives under `routing` (each sample's [tokens, layers, k])."""
    stacked = torch.cat(routing).long()  # [tokens, layers, k]
    return torch.stack([torch.bincount(stacked[:, layer].flatten(), minlength=num_experts)
                        for layer in range(stacked.shape[1])]).double()


@pytest.fixture(scope="module")
def moe_group(rank_pool, module_tmp):
    model_dir = make_tiny_model(module_tmp.mktemp("moe") / "qwen3_moe", model_spec(architecture="qwen3_moe"))
    samples, _ = scored_batch(lambda batch: hf_logprobs(model_dir, batch))
    spec = actor_spec(model_dir, 1, 1, 2, {"ep": 2, "lr": 0.05})
    spec = dataclasses.replace(spec, algo=AlgoConfig(routing_replay="old", num_minibatches=2))
    with rank_pool.group(spec) as group:
        yield group, samples


def test_routing_replay_routes_every_update_as_recorded(moe_group):
    group, samples = moe_group
    logprobs, recorded = group.compute_logprobs_and_routing(samples)
    plain = group.compute_logprobs(samples)
    assert max(abs(a - b) for row, ref in zip(logprobs, plain) for a, b in zip(row, ref, strict=True)) <= 1e-6
    assert [r.shape for r in recorded] == [(len(s.token_ids), 2, 2) for s in samples]
    assert all(((r >= 0) & (r < 8)).all() and (r[..., 0] != r[..., 1]).all() for r in recorded)
    replayed = [dataclasses.replace(s, routed_experts=r) for s, r in zip(samples, recorded)]
    expected = _tokens_per_expert(recorded, 8)

    first = group.train_step(replayed)
    assert torch.equal(group.last_tokens_per_expert, expected)
    # the update moved the router: routed afresh, tokens now go to other experts
    _, rerouted = group.compute_logprobs_and_routing(samples)
    changed = sum(int((a != b).any(-1).sum()) for a, b in zip(recorded, rerouted))
    assert changed > 0
    assert not torch.equal(_tokens_per_expert(rerouted, 8), expected)
    # a second update of the same step still routes every token to exactly the recorded experts
    group.train_step(replayed)
    assert torch.equal(group.last_tokens_per_expert, expected)

    for layer in range(2):
        balance = expected[layer].max() / expected[layer].mean()
        assert first[f"moe/expert_load_max_over_mean/layer_{layer}"] == pytest.approx(float(balance))
    worst = (expected.max(1).values / expected.mean(1)).max()
    assert first["moe/expert_load_max_over_mean"] == pytest.approx(float(worst))
    assert first["moe/dropped_token_fraction"] == 0.0  # no capacity limit: every token reaches its k experts


def test_policy_update_records_the_old_routing_and_replays_it(moe_group):
    group, samples = moe_group
    steps = [dataclasses.replace(s, old_logprobs=None) for s in samples]
    update = policy_update(group, steps, group.spec.algo)
    assert update.metrics["actor/updates"] == 2.0
    assert all(s.routed_experts is not None and s.old_logprobs is not None for s in steps)
    # the last update routed as the old-logprob pass did (the first one's update moved the router in between)
    second_half = steps[len(steps) // 2:]
    assert torch.equal(group.last_tokens_per_expert, _tokens_per_expert([s.routed_experts for s in second_half], 8))
    assert "moe/expert_load_max_over_mean" in update.metrics


def test_uneven_expert_parallel_shards_run_without_waiting_on_each_other(moe_group):
    """Every micro-batch's MoE layers exchange tokens across the expert-parallel ranks: a rank with fewer
    micro-batches (or none: a one-sample batch leaves the second rank's shard empty) runs idle ones instead of leaving
    the other waiting at an all-to-all."""
    from rlsearch.actor import TrainSample

    group, samples = moe_group
    generator = torch.Generator().manual_seed(5)
    long = [TrainSample(torch.randint(0, TEST_VOCAB_RANKS, (150,), generator=generator).tolist(), 20, [1] * 130)
            for _ in range(3)]
    short = TrainSample(samples[0].token_ids, samples[0].response_start, samples[0].loss_mask)
    alone = group.compute_logprobs([short])  # shards [short] and []
    mixed = group.compute_logprobs(long + [short])  # shards of 3 micro-batches and of 1
    assert [len(row) for row in mixed] == [s.response_len for s in long + [short]]
    assert max(abs(a - b) for a, b in zip(alone[0], mixed[-1], strict=True)) <= 1e-5
    assert group.train_step([dataclasses.replace(s, token_weights=[1 / 130] * s.response_len) for s in long] +
                            [dataclasses.replace(short, token_weights=[0.0] * short.response_len)])[
        "actor/update_ok"] == 1.0
