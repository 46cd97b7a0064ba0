"""Actor checkpoints: saved from one layout, loaded into another (Megatron reshards on load), training goes on as
if it had never stopped: same weights, same optimizer moments, same learning-rate schedule. A save leaves no process
behind."""

from __future__ import annotations

from dataclasses import replace

import psutil
import pytest
import ray
import torch

from tests.integration.actor_helpers import actor_spec, hf_logprobs, max_diff, scored_batch

# warm-up: the learning rate changes every step, so a lost schedule position shows
SETTINGS = {"lr_warmup_steps": 3, "lr": 1e-4}


def test_resume_tp1pp1_checkpoint_into_tp2pp1_trains_on_identically(rank_pool, tiny_model_dir, tmp_path):
    samples, _ = scored_batch(lambda s: hf_logprobs(tiny_model_dir, s))
    # the second step pushes the other way: with Adam's first moment restored the two gradients mostly cancel, while
    # a freshly started Adam would take a full step of size lr
    reversed_samples = [replace(sample, advantage=-sample.advantage) for sample in samples]
    checkpoint = tmp_path / "megatron"
    checkpoint.mkdir()

    with rank_pool.group(actor_spec(tiny_model_dir, 1, 1, 1, SETTINGS)) as source:
        first = source.train_step(samples)
        source.save_checkpoint(str(checkpoint))
        # and left no process behind (no Manager server for the writer's results: megatron.parallel.save_sharded)
        left = ray.get(source.workers[0].__ray_call__.remote(
            lambda _: [" ".join(child.cmdline()) for child in psutil.Process().children(recursive=True)]))
        assert left == [], left
        saved_weights = source.hf_state_dict()
        second = source.train_step(reversed_samples)
        uninterrupted = source.hf_state_dict()

    with rank_pool.group(actor_spec(tiny_model_dir, 2, 1, 1, SETTINGS)) as resumed:
        assert resumed.load_checkpoint(str(checkpoint), restore_rng=False) == 1  # the scheduler's step count
        loaded_weights = resumed.hf_state_dict()
        second_resumed = resumed.train_step(reversed_samples)
        resumed_weights = resumed.hf_state_dict()

    assert max_diff(loaded_weights, saved_weights) == 0.0  # TP1 shards -> TP2 shards, bit-exact
    assert second["actor/lr"] > first["actor/lr"] > 0  # warm-up: each step has its own learning rate
    for key in ("actor/lr", "actor/policy_loss", "actor/grad_norm", "actor/clip_fraction"):
        assert second_resumed[key] == pytest.approx(second[key], abs=1e-6, rel=1e-6), key
    moved = max_diff(uninterrupted, saved_weights)
    updates = torch.cat([(uninterrupted[n] - saved_weights[n]).flatten() for n in saved_weights]).abs()
    updates = updates[updates > 0]
    print(f"\nstep 2: lr {second['actor/lr']:.2e}, max |update| {moved:.2e}, median {updates.median():.2e}, "
          f"resumed vs uninterrupted {max_diff(resumed_weights, uninterrupted):.2e}")
    # with the restored first moment the step mostly cancels (a fresh Adam would move each weight by about lr) ...
    assert 1e-3 * second["actor/lr"] < updates.median() < 0.3 * second["actor/lr"]
    # ... and the resumed run made the same step (TP2 reduces in another order: 2.4e-7 seen, vs updates up to 3e-5)
    assert max_diff(resumed_weights, uninterrupted) < 1e-6
