"""A NaN advantage (what a scorer's NaN reward becomes) makes the real Megatron step's loss and gradients NaN: the
actor skips the optimizer and LR-scheduler steps, so weights, Adam state and schedule are exactly as before."""

from __future__ import annotations

import math

import torch

from rlsearch.actor import TrainSample
from rlsearch.algo import grpo_advantages, loss_token_weights
from tests.models import TEST_VOCAB_RANKS


def _batch(advantages: list[float]) -> list[TrainSample]:
    """On-policy sequences of 24-42 random tokens with a masked observation span."""
    generator = torch.Generator().manual_seed(3)
    samples = []
    for index, advantage in enumerate(advantages):
        length, start = 24 + 6 * index, 5 + index
        ids = torch.randint(0, TEST_VOCAB_RANKS, (length,), generator=generator).tolist()
        samples.append(TrainSample(ids, start, [0 if 6 <= i < 10 else 1 for i in range(length - start)], advantage))
    for sample, weights in zip(samples, loss_token_weights([s.loss_mask for s in samples], "token_mean")):
        sample.token_weights = weights
    return samples


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert set(a) == set(b)
    return [name for name in a if torch.equal(a[name], b[name])]


def test_nan_advantage_step_is_skipped_and_changes_nothing(actor_ranks, tmp_path):
    # a NaN reward from a scorer poisons its whole group's advantages: that is the fault injected below
    assert torch.isnan(grpo_advantages(torch.tensor([1.0, float("nan"), 0.0, 1.0]), [0, 0, 1, 1])[:2]).all()
    good = _batch([1.0, -0.5, 0.8, -1.3])
    bad = _batch([1.0, float("nan"), 0.8, -1.3])
    start, after_bad = tmp_path / "start", tmp_path / "after_bad"
    start.mkdir()
    after_bad.mkdir()
    # a checkpoint loads only into an optimizer that has state: a zero-advantage step creates it (zero gradients, so
    # the weights of a fresh fixture stay those of the HF model); the fixture is left in the state saved here
    warm_up = actor_ranks.train_step(_batch([0.0, 0.0, 0.0, 0.0]))
    assert warm_up["actor/skipped_nonfinite"] == 0.0 and warm_up["actor/grad_norm"] == 0.0
    actor_ranks.save_checkpoint(str(start))
    try:
        before = actor_ranks.hf_state_dict()
        skipped = actor_ranks.train_step(bad)
        assert math.isnan(skipped["actor/policy_loss"])
        assert skipped["actor/skipped_nonfinite"] == 1.0
        assert skipped["actor/update_ok"] == 0.0
        assert math.isnan(skipped["actor/grad_norm"])
        unchanged = actor_ranks.hf_state_dict()
        assert len(_equal(before, unchanged)) == len(before)  # every parameter bit-identical
        actor_ranks.save_checkpoint(str(after_bad))

        stepped = actor_ranks.train_step(good)  # the run goes on: the next good batch updates
        assert stepped["actor/skipped_nonfinite"] == 0.0 and stepped["actor/update_ok"] == 1.0
        assert math.isfinite(stepped["actor/grad_norm"]) and stepped["actor/grad_norm"] > 0
        after_skip_then_good = actor_ranks.hf_state_dict()
        assert _equal(before, after_skip_then_good) == []  # every tensor moved

        # the skipped step left the LR schedule's step count and the Adam moments/step count as they were: the same
        # good step from the state saved before the NaN batch lands on the same bits
        scheduler_steps_after_bad = actor_ranks.load_checkpoint(str(after_bad), restore_rng=True)
        assert actor_ranks.load_checkpoint(str(start), restore_rng=True) == scheduler_steps_after_bad
        direct = actor_ranks.train_step(good)
        assert direct["actor/grad_norm"] == stepped["actor/grad_norm"] and direct["actor/lr"] == stepped["actor/lr"]
        direct_weights = actor_ranks.hf_state_dict()
        assert len(_equal(direct_weights, after_skip_then_good)) == len(before)
    finally:
        actor_ranks.load_checkpoint(str(start), restore_rng=True)
