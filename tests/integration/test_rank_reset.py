"""A started rank process `reset` into another group (MegatronActorWorker.reset, ActorRanks' ``workers``: how the
suite's RankPool re-uses its ranks) computes what a new process computes: after a DP2 group trained in them, the
same two processes as a TP2 group take a GRPO step bit-identical to a TP2 group of new processes. That reference
group is ``detached`` (as a supervised driver's): shut down, it leaves both ranks running, and the next detached group
of two takes both over, the same processes, and computes the same step again."""

from __future__ import annotations

import torch

from rlsearch.actor import ActorRanks, stop_detached_ranks
from tests.integration.actor_helpers import actor_spec, hf_logprobs, scored_batch


def test_reset_ranks_train_as_new_ones(rank_pool, tiny_model_dir):
    samples, _ = scored_batch(lambda batch: hf_logprobs(tiny_model_dir, batch))
    tp2 = actor_spec(tiny_model_dir, 2, 1, 1, {})
    try:
        fresh = ActorRanks(tp2, detached=True)
        want_logprobs = fresh.compute_logprobs(samples)
        want_metrics = fresh.train_step(samples)
        want_weights = fresh.hf_state_dict()
        fresh.shutdown()  # graceful: reset and left running
        taken = ActorRanks(tp2, detached=True)
        assert (taken.adopted, taken.workers) == ([0, 1], fresh.workers)
        assert taken.compute_logprobs(samples) == want_logprobs
        assert taken.train_step(samples) == want_metrics
        taken.shutdown(graceful=False)
    finally:
        stop_detached_ranks()

    rank_pool.drain()
    with rank_pool.group(actor_spec(tiny_model_dir, 1, 1, 2, {"lr": 1e-3})) as earlier:
        earlier.train_step(samples)  # another layout, learning rate and optimizer state in the same processes
        processes = list(earlier.workers)
    with rank_pool.group(tp2) as reset:
        assert reset.workers == processes  # the same two processes, not new ones
        logprobs = reset.compute_logprobs(samples)
        metrics = reset.train_step(samples)
        weights = reset.hf_state_dict()

    assert logprobs == want_logprobs
    assert metrics == want_metrics
    assert set(weights) == set(want_weights)
    assert all(torch.equal(weights[name], want_weights[name]) for name in want_weights)
