"""The distributed optimizer (actor.use_distributed_optimizer) through checkpoints.

One DP2 actor with the distributed optimizer trains four steps, saving a run checkpoint after the second, and is
then killed. Fresh actors with the distributed optimizer load that checkpoint (at DP2, with the RNG states, and at
DP1: Megatron reshards the optimizer states) and train steps 3 and 4 again: each must reproduce the uninterrupted
run. The checkpoint converts to HuggingFace bit-exact.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from rlsearch.checkpoint import CheckpointStore, mcore_to_hf
from tests.integration.actor_helpers import actor_spec, hf_logprobs, max_diff, scored_batch

# warm-up: the learning rate changes every step, so a lost schedule position shows
SETTINGS = {"lr_warmup_steps": 5, "lr": 1e-4, "use_distributed_optimizer": True}
STEPS = 4
SAVED_AFTER = 2
# name -> (dp, extra actor settings) of the actors that resume the checkpoint
RESUMED = {"dp2": (2, {}), "dp1": (1, {})}


@pytest.fixture(scope="module")
def step_batches(tiny_model_dir):
    """The batch of each step: the advantages flip every step, so with Adam's first moment restored consecutive
    updates mostly cancel while a fresh Adam would take full steps."""
    samples, _ = scored_batch(lambda s: hf_logprobs(tiny_model_dir, s))
    flipped = [replace(sample, advantage=-sample.advantage) for sample in samples]
    return [samples if step % 2 else flipped for step in range(1, STEPS + 1)]


@pytest.fixture(scope="module")
def uninterrupted(rank_pool, tiny_model_dir, step_batches, module_tmp):
    """(weights after each step, metrics of each step, the run checkpoint after step SAVED_AFTER) of the DP2 actor,
    whose ranks are reset at the end (RankPool): only the checkpoint remains of it."""
    store = CheckpointStore(module_tmp.mktemp("run"))
    weights, metrics, checkpoint = {}, {}, None
    with rank_pool.group(actor_spec(tiny_model_dir, 1, 1, 2, SETTINGS)) as group:
        for step, samples in enumerate(step_batches, start=1):
            metrics[step] = group.train_step(samples)
            weights[step] = group.hf_state_dict()
            if step == SAVED_AFTER:
                info = {"layout": {"tp": 1, "pp": 1, "cp": 1, "dp": 2, "ep": 1, "virtual_pipeline_stages": 0},
                        "architecture": "qwen2", "dtype": "float32", "contents": ["model", "optimizer", "scheduler"],
                        "transformer_impl": group.infos[0].transformer_impl}
                checkpoint = store.save(step, group.save_checkpoint, {"seed": 1}, tiny_model_dir, info)
    return weights, metrics, checkpoint


@pytest.fixture(scope="module")
def resumed(rank_pool, tiny_model_dir, step_batches, uninterrupted):
    _, _, checkpoint = uninterrupted
    cache: dict[str, tuple] = {}

    def run(name: str) -> tuple[int, dict, dict, dict]:
        """(the step count loaded, the weights loaded, weights after each later step, metrics of each later step)."""
        if name not in cache:
            dp, extra = RESUMED[name]
            with rank_pool.group(actor_spec(tiny_model_dir, 1, 1, dp, {**SETTINGS, **extra})) as group:
                loaded_step = group.load_checkpoint(str(checkpoint / "megatron"), restore_rng=name == "dp2")
                loaded = group.hf_state_dict()
                weights, metrics = {}, {}
                for step in range(SAVED_AFTER + 1, STEPS + 1):
                    metrics[step] = group.train_step(step_batches[step - 1])
                    weights[step] = group.hf_state_dict()
            cache[name] = (loaded_step, loaded, weights, metrics)
        return cache[name]

    return run


@pytest.mark.parametrize("name", list(RESUMED))
def test_distributed_optimizer_checkpoint_resumes_exactly(uninterrupted, resumed, name):
    weights, metrics, _ = uninterrupted
    loaded_step, loaded, resumed_weights, resumed_metrics = resumed(name)
    assert loaded_step == SAVED_AFTER  # the scheduler's step count
    assert max_diff(loaded, weights[SAVED_AFTER]) == 0.0
    assert metrics[4]["actor/lr"] > metrics[3]["actor/lr"] > metrics[2]["actor/lr"]  # warm-up: a lr per step
    for step in range(SAVED_AFTER + 1, STEPS + 1):
        for key in ("actor/lr", "actor/policy_loss", "actor/grad_norm"):
            assert resumed_metrics[step][key] == pytest.approx(metrics[step][key], abs=1e-6, rel=1e-6), (step, key)
        moved = max_diff(weights[step], weights[step - 1])
        worst = max_diff(resumed_weights[step], weights[step])
        print(f"\n{name} step {step}: resumed vs uninterrupted {worst:.2e} (the step moved weights up to {moved:.2e})")
        assert moved > 1e-5
        assert worst < 1e-6
    # with Adam's moments restored the flipped step mostly cancels the previous one; a fresh Adam takes a full step
    # of about lr on every weight
    updates = torch.cat([(weights[3][n] - weights[2][n]).flatten() for n in weights[2]]).abs()
    assert updates[updates > 0].median() < 0.3 * metrics[3]["actor/lr"]


def test_distributed_optimizer_checkpoint_converts_to_hf_bit_exact(uninterrupted, tmp_path):
    weights, _, checkpoint = uninterrupted
    converted = mcore_to_hf(checkpoint, tmp_path / "hf")
    tensors = {}
    for path in sorted(converted.out_dir.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    assert set(tensors) == set(weights[SAVED_AFTER])
    for name, tensor in weights[SAVED_AFTER].items():
        assert torch.equal(tensors[name], tensor), name
