"""Context parallelism and prefix merging in the Megatron actor, against segments trained one by one at CP1.

One batch of re-rendered multi-segment trajectories (segments sharing prefixes of different lengths, and none) and
plain samples of different lengths: every layout scores it, takes one GRPO step on it and exports its weights. The
baseline trains every segment on its own (actor.merge_prefixes false, cp 1). cp2 and pp2cp2 also merge prefixes
(tp2cp2 does not): a tree split into context-parallel chunks must train as its segments one by one. Chunked logits
are on everywhere (chunks of 16 positions) except in the baseline, which takes the whole output layer in one piece.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import ray
import torch

from rlsearch.actor import MODEL_DISTRIBUTION, ActorRanks, TrainSample
from rlsearch.weights import WeightSync, logprob_mismatch
from tests.integration.actor_helpers import actor_spec, long_sequence_batch

# name -> (tp, pp, cp, merge_prefixes)
LAYOUTS = {
    "baseline": (1, 1, 1, False),
    "cp2": (1, 1, 2, True),
    "tp2cp2": (2, 1, 2, False),
    "pp2cp2": (1, 2, 2, True),
}
PARITY = 1e-5


@dataclass
class LayoutRun:
    logprobs: list[list[float]]
    metrics: dict[str, float]
    trained: dict[str, torch.Tensor]
    engine_vs_actor: float | None = None  # max |logprob diff| on the probe after a sync (cp2 only)
    # cp2's checkpoint loaded by a CP1 actor (cp2 only)
    resumed_at_cp1: dict[str, torch.Tensor] | None = None


@pytest.fixture(scope="module")
def batch(tiny_model_dir):
    return long_sequence_batch(tiny_model_dir)


@pytest.fixture(scope="module")
def run_layout(rank_pool, tiny_model_dir, rollout_worker, batch, module_tmp):
    samples, _ = batch
    cache: dict[str, LayoutRun] = {}
    kept: dict[str, ActorRanks] = {}  # the baseline's group, which later loads cp2's checkpoint

    def run(name: str) -> LayoutRun:
        if name in cache:
            return cache[name]
        tp, pp, cp, merge = LAYOUTS[name]
        chunk = 0 if name == "baseline" else 16
        extra = {"cp": cp, "merge_prefixes": merge, "logits_chunk_tokens": chunk, "max_tokens_per_microbatch": 200}
        with contextlib.ExitStack() as this_run:
            group = (held if name == "baseline" else this_run).enter_context(
                rank_pool.group(actor_spec(tiny_model_dir, tp, pp, 1, extra)))
            if name == "baseline":
                kept[name] = group
            result = LayoutRun(group.compute_logprobs(samples), group.train_step(samples), group.hf_state_dict())
            if name == "cp2":
                probe = ray.get(rollout_worker.probe_sequence.remote("Who founded Velmora?", "<search> mayor"))
                actor_probe = group.compute_logprobs([TrainSample(probe, 1, [1] * (len(probe) - 1))],
                                                     distribution=MODEL_DISTRIBUTION)[0]
                WeightSync(group, 64, "shm", 120.0, engine_tp=1).sync([rollout_worker])
                result.engine_vs_actor = logprob_mismatch(ray.get(rollout_worker.score.remote(probe)), actor_probe)[0]
                checkpoint = module_tmp.mktemp("cp2-checkpoint")
                group.save_checkpoint(str(checkpoint))
        if name == "cp2":
            run("baseline")  # its result is taken: its CP1 group now loads the checkpoint
            kept["baseline"].load_checkpoint(str(checkpoint), restore_rng=False)
            result.resumed_at_cp1 = kept["baseline"].hf_state_dict()
        cache[name] = result
        return result

    with contextlib.ExitStack() as held:  # the baseline's group, to the module's end
        yield run


def _assert_same_step(result: LayoutRun, baseline: LayoutRun, batch) -> None:
    _, reference = batch
    assert max((torch.tensor(a) - b).abs().max().item() for a, b in zip(result.logprobs, reference)) < PARITY
    worst = max((torch.tensor(a) - torch.tensor(b)).abs().max().item()
                for a, b in zip(result.logprobs, baseline.logprobs))
    assert worst < PARITY
    for key in ("actor/policy_loss", "actor/clip_fraction", "actor/approx_kl", "actor/entropy", "actor/grad_norm"):
        assert result.metrics[key] == pytest.approx(baseline.metrics[key], abs=PARITY), key
    assert baseline.metrics["actor/entropy"] > 1.0
    assert set(result.trained) == set(baseline.trained)
    assert max((result.trained[n] - baseline.trained[n]).abs().max().item() for n in baseline.trained) < PARITY


@pytest.mark.parametrize("layout", ["cp2", "tp2cp2", "pp2cp2"])
def test_context_parallel_matches_cp1(run_layout, batch, layout):
    _assert_same_step(run_layout(layout), run_layout("baseline"), batch)


def test_context_parallel_checkpoint_resumes_at_cp1_and_syncs(run_layout):
    result = run_layout("cp2")
    assert set(result.resumed_at_cp1) == set(result.trained)
    for name, tensor in result.trained.items():
        assert torch.equal(result.resumed_at_cp1[name], tensor), name
    assert result.engine_vs_actor < 1e-4
