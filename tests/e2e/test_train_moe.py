"""The MoE example config end to end on CPU: a tiny Qwen3-MoE whose experts are split over two actor ranks
(actor.ep=2), routing replayed in every update, weights synced into the vLLM engine after each step, as deltas
(weights.delta) staged while the engine generates the next step's rollout (rollout.async_steps=1)."""

import os
import subprocess

import pytest

from tests.constants import REPO_ROOT, SHORT_TURNS
from tests.models import model_override


@pytest.mark.memory_heavy
def test_moe_config_trains_three_steps_with_expert_parallelism(tmp_path, driver_ray):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    env = {**os.environ, "RLSEARCH_CONFIG": "examples/configs/search_grpo_moe_tiny.yaml", **driver_ray}
    result = subprocess.run(
        ["bash", "examples/run_search_grpo.sh", "trainer.total_steps=3", "data.batch_size=2", "weights.delta=true",
         "rollout.async_steps=1", SHORT_TURNS, model_override(architecture="qwen3_moe"), f"trainer.output_dir={out}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=1200, env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "step 3/3 | reward" in result.stdout
    assert "warm start" not in result.stdout  # the MoE config trains its own model, not the dense SFT one
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    for name in ("actor/update_ok", "actor/updates", "moe/expert_load_max_over_mean", "moe/dropped_token_fraction",
                 "moe/expert_load_max_over_mean/layer_1", "weights/logprob_mismatch_max", "weights/pause_s",
                 "weights/time/export", "weights/time/stage", "weights/time/load", "weights/time/probe",
                 "weights/delta"):
        assert [e.step for e in events.Scalars(name)] == [1, 2, 3], name
    assert all(e.value == 1.0 for e in events.Scalars("actor/update_ok"))
    assert all(e.value == 2.0 for e in events.Scalars("actor/updates"))  # two mini-batches: routing replay acts
    # 8 experts, top-2: 1.0 is a perfect balance, 8.0 one expert taking every token
    assert all(1.0 <= e.value <= 8.0 for e in events.Scalars("moe/expert_load_max_over_mean"))
    assert all(e.value == 0.0 for e in events.Scalars("moe/dropped_token_fraction"))
    # staged first: the engine stood still only to load the staged buckets and finish, not while they were exported
    pauses, syncs = events.Scalars("weights/pause_s"), events.Scalars("time/sync_s")
    assert all(0.0 < pause.value < sync.value for pause, sync in zip(pauses, syncs))
    # the first sync sends the weights whole, the next ones only what changed (experts no token reached, and
    # embedding rows of tokens not in the batch, keep their bits)
    assert [e.value for e in events.Scalars("weights/delta")] == [0.0, 1.0, 1.0]
    wire, whole = events.Scalars("weights/wire_mib"), events.Scalars("weights/sync_mib")
    assert wire[0].value >= whole[0].value
    assert all(w.value < s.value for w, s in zip(wire[1:], whole[1:]))
    # the engine samples from the weights the actor trains after every sync (experts included): the fp32 probe's
    # limit, as for the dense runs (test_moe_sync's probe measured 9.5e-7)
    assert max(e.value for e in events.Scalars("weights/logprob_mismatch_max")) < 1e-4
