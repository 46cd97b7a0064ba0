"""Megatron TP x PP x DP layouts against HF transformers and each other, and the bridge from each into vLLM.

Every layout starts from the same HF weights, scores the same packed batch, takes one GRPO step on it and syncs
into the same vLLM engine. Layout runs are cached per module: each group of Ray ranks starts once.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import ray
import torch
from safetensors.torch import load_file

from rlsearch.actor import MODEL_DISTRIBUTION, TrainSample
from rlsearch.data.tiny_model import make_tiny_model
from rlsearch.weights import WeightSync, logprob_mismatch
from tests.integration.actor_helpers import actor_spec, hf_logprobs, scored_batch, sent_tensors
from tests.models import model_spec

pytestmark = pytest.mark.memory_heavy  # holds several GiB at once: never beside another such module

# name -> (tp, pp, dp, extra actor settings)
LAYOUTS = {
    "tp1pp1": (1, 1, 1, {}),
    "tp2pp1": (2, 1, 1, {}),
    "tp1pp2": (1, 2, 1, {}),
    "tp2pp2": (2, 2, 1, {}),
    "dp2": (1, 1, 2, {"use_distributed_optimizer": True}),
}
PROBE_QUESTION = "Who is the mayor of Velmora?"
PROBE_CONTINUATION = "<search> who founded the town </search>"


@dataclass
class LayoutRun:
    """What the checks need of a layout's run. Of the weights only the trained ones are kept (a layout's three full
    copies of the model, 5 x 3 x 156 MB, held the lane at 3.5 GB beside the memory-heavy engines): the exports are
    compared where they are made."""

    initial_vs_hf: list[str]  # weights the first export got wrong against the HF file: missing, extra or not bit-equal
    logprobs: list[list[float]]
    metrics: dict[str, float]
    trained: dict[str, torch.Tensor]  # mbridge's export after the step
    moved: float  # max |trained - initial export|
    sent_vs_trained: list[str]  # weights the export after the step sent other than mbridge's export
    engine_vs_actor: float  # max |logprob diff| on the probe after the sync
    sweep_engine_logprobs: dict[int, list[float]]


def not_bit_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    """The names missing from `actual`, extra in it, or holding other values than in `expected`."""
    return sorted(set(actual) ^ set(expected)) + [
        name for name in expected if name in actual and not torch.equal(actual[name], expected[name])]


@pytest.fixture(scope="module")
def batch(tiny_model_dir):
    return scored_batch(lambda samples: hf_logprobs(tiny_model_dir, samples))


@pytest.fixture(scope="module")
def run_layout(rank_pool, tiny_model_dir, rollout_worker, batch):
    samples, _ = batch
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    probe = ray.get(rollout_worker.probe_sequence.remote(PROBE_QUESTION, PROBE_CONTINUATION))
    probe_sample = TrainSample(probe, 1, [1] * (len(probe) - 1))
    cache: dict[str, LayoutRun] = {}

    def run(name: str) -> LayoutRun:
        if name in cache:
            return cache[name]
        tp, pp, dp, extra = LAYOUTS[name]
        with rank_pool.group(actor_spec(tiny_model_dir, tp, pp, dp, extra)) as group:
            initial_export = sent_tensors(group, 64)
            logprobs = group.compute_logprobs(samples)
            metrics = group.train_step(samples)
            trained = group.hf_state_dict()
            sent = sent_tensors(group, 64)
            actor_probe = group.compute_logprobs([probe_sample], distribution=MODEL_DISTRIBUTION)[0]
            sweep = {}
            for bucket_mb in ((1, 16, 512) if name == "tp2pp2" else (64,)):
                WeightSync(group, bucket_mb, "shm", 120.0, engine_tp=1).sync([rollout_worker])
                sweep[bucket_mb] = ray.get(rollout_worker.score.remote(probe))
            engine_vs_actor = max(logprob_mismatch(engine, actor_probe)[0] for engine in sweep.values())
        moved = max((trained[n] - initial_export[n]).abs().max().item() for n in trained if n in initial_export)
        cache[name] = LayoutRun(not_bit_equal(initial_export, original), logprobs, metrics, trained, moved,
                                not_bit_equal(sent, trained), engine_vs_actor, sweep)
        return cache[name]

    return run


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logprob_parity_with_hf(run_layout, batch, layout):
    _, reference = batch
    result = run_layout(layout)
    worst = max((torch.tensor(a) - b).abs().max().item() for a, b in zip(result.logprobs, reference))
    assert worst < 1e-5


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "tp1pp1"])
def test_grpo_step_parity_across_layouts(run_layout, layout):
    baseline, result = run_layout("tp1pp1"), run_layout(layout)
    assert baseline.metrics["actor/clip_fraction"] > 0.05  # the off-policy ratios exercise the clip
    for key in ("actor/policy_loss", "actor/clip_fraction", "actor/approx_kl", "actor/grad_norm"):
        assert result.metrics[key] == pytest.approx(baseline.metrics[key], abs=1e-5), key
    assert set(result.trained) == set(baseline.trained)
    worst = max((result.trained[n] - baseline.trained[n]).abs().max().item() for n in baseline.trained)
    assert worst < 1e-5
    assert baseline.moved > 5e-6  # the step did change the weights, so agreeing on them means something


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bridge_sends_exactly_the_hf_weights(run_layout, layout):
    result = run_layout(layout)
    assert result.initial_vs_hf == []  # HF -> Megatron shards -> HF, bit-exact, every name and no other
    assert result.sent_vs_trained == []  # buckets == mbridge's export


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bridge_engine_matches_actor_after_sync(run_layout, layout):
    assert run_layout(layout).engine_vs_actor < 1e-4


def test_bridge_bucket_size_sweep_gives_identical_engine_logprobs(run_layout):
    sweep = run_layout("tp2pp2").sweep_engine_logprobs
    assert set(sweep) == {1, 16, 512}
    assert sweep[1] == sweep[16] == sweep[512]


@pytest.mark.parametrize(
    "architecture, tied, tp, pp",
    [("qwen2", True, 1, 2), ("llama", False, 2, 1), ("qwen3", True, 2, 2)],
    ids=["qwen2-tied-tp1pp2", "llama-tp2pp1", "qwen3-tied-tp2pp2"],
)
def test_architecture_parity_and_round_trip(rank_pool, tmp_path_factory, architecture, tied, tp, pp):
    model_dir = make_tiny_model(
        tmp_path_factory.mktemp(architecture) / "model", model_spec(architecture=architecture,
                                                                        tie_word_embeddings=tied),
    )
    samples, reference = scored_batch(lambda s: hf_logprobs(model_dir, s))
    with rank_pool.group(actor_spec(model_dir, tp, pp, 1, {})) as group:
        sent = sent_tensors(group, 64)
        logprobs = group.compute_logprobs(samples)
        metrics = group.train_step(samples)
    assert max((torch.tensor(a) - b).abs().max().item() for a, b in zip(logprobs, reference)) < 1e-5
    original = load_file(str(model_dir / "model.safetensors"))
    assert set(sent) == set(original)
    assert all(torch.equal(sent[name], tensor) for name, tensor in original.items())
    assert metrics["actor/update_ok"] == 1.0 and metrics["actor/grad_norm"] > 0
