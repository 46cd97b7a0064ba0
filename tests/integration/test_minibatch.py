"""PPO updates that use the clip (algo.num_minibatches): the old logprobs come from one forward pass before the
first update, so the first mini-batch's ratio is 1 and the second's is not (the first update moved the policy),
and TP1PP1, TP2PP1 and TP1PP2 take the same two updates."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rlsearch.config import AlgoConfig
from rlsearch.trainer.update import policy_update
from tests.integration.actor_helpers import actor_spec, hf_logprobs, scored_batch

LAYOUTS = {"tp1pp1": (1, 1), "tp2pp1": (2, 1), "tp1pp2": (1, 2)}
# a large step and a narrow clip range: many of the second update's ratios leave [1 - 0.001, 1 + 0.001]
ALGO = AlgoConfig(num_minibatches=2, clip_ratio_low=0.001, clip_ratio_high=0.001)
LR = 1e-4


@pytest.fixture(scope="module")
def run_layout(rank_pool, tiny_model_dir):
    samples, _ = scored_batch(lambda s: hf_logprobs(tiny_model_dir, s))
    cache = {}

    def run(name: str):
        if name not in cache:
            tp, pp = LAYOUTS[name]
            spec = replace(actor_spec(tiny_model_dir, tp, pp, 1, {"lr": LR}), algo=ALGO)
            with rank_pool.group(spec) as group:
                # the crafted old logprobs are dropped: the update computes the old policy's itself
                update = policy_update(group, [replace(s, old_logprobs=None) for s in samples], ALGO)
                cache[name] = (update, group.hf_state_dict())
        return cache[name]

    return run


def test_second_minibatch_update_is_clipped(run_layout):
    update, _ = run_layout("tp1pp1")
    first, second = update.per_update
    assert update.metrics["actor/updates"] == 2.0
    assert first["actor/clip_fraction"] == 0.0
    assert first["actor/approx_kl"] < 1e-10  # ratio 1 up to float noise: old logprobs are the current policy's
    assert second["actor/clip_fraction"] > 0.05
    assert second["actor/approx_kl"] > 1e-6
    assert first["actor/update_ok"] == second["actor/update_ok"] == 1.0
    mean = (first["actor/clip_fraction"] + second["actor/clip_fraction"]) / 2
    assert update.metrics["actor/clip_fraction"] == pytest.approx(mean)
    print(f"\nclip fraction {first['actor/clip_fraction']:.4f} -> {second['actor/clip_fraction']:.4f}, approx KL "
          f"{first['actor/approx_kl']:.2e} -> {second['actor/approx_kl']:.2e}")


@pytest.mark.parametrize("layout", ["tp2pp1", "tp1pp2"])
def test_minibatch_updates_agree_across_layouts(run_layout, layout):
    (baseline, weights), (result, other) = run_layout("tp1pp1"), run_layout(layout)
    for base, update in zip(baseline.per_update, result.per_update, strict=True):
        for key in ("actor/policy_loss", "actor/clip_fraction", "actor/approx_kl"):
            assert update[key] == pytest.approx(base[key], abs=1e-5), key
    worst = max((other[name] - weights[name]).abs().max().item() for name in weights)
    print(f"\n{layout}: max |weight diff| vs tp1pp1 {worst:.2e}")
    assert worst < 1e-5
