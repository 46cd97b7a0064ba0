"""bf16 trains: `bash examples/run_search_grpo.sh` with bf16 weights (the actor's Megatron parameters and both vLLM
engines), sampling at temperature 0.7 (the random-init model, RLSEARCH_WARM_START=none), 2 steps (two syncs). The
probe gap after every sync is logged and under the bf16 limit, which the fp32 limit of 1e-4 it used to run with was
not. IcePop in a narrow band ([0.998, 1.002]) corrects the rollout: in bf16 the engine's and the actor's logprobs of
a token differ after a sync (r is not 1, as it is within 1e-4 in fp32), so some trained tokens fall outside the band
and are masked, and the kept ones are weighted by their r. (Before the first sync the random model's near-uniform
distribution kept every r of step 1 within [0.995, 1.005] on this CPU; step 2 masked 7.6% of its tokens there.)"""

from __future__ import annotations

import json

from rlsearch.weights import default_mismatch_limit
from tests.drivers import run_search_grpo

ICEPOP_LOW, ICEPOP_HIGH = 0.998, 1.002


def test_a_bf16_run_with_two_engines_trains_two_steps_under_the_bf16_probe_limit(tmp_path, driver_ray):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    # small steps: Megatron's bf16 backward runs ~10x slower than fp32 on a CPU without bf16 matrix instructions
    result = run_search_grpo(out, "model.dtype=bfloat16", "rollout.num_engines=2", "rollout.temperature=0.7",
                             "trainer.total_steps=2", "data.batch_size=2", "rollout.group_size=2",
                             "algo.num_minibatches=1", "algo.rollout_correction=icepop",
                             f"algo.icepop_low={ICEPOP_LOW}", f"algo.icepop_high={ICEPOP_HIGH}", timeout=1500,
                             **driver_ray)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "step 2/2 | reward" in result.stdout
    assert "engine vs actor logprobs before training: max |diff|" in result.stdout
    assert json.loads((out / "config.json").read_text())["model"]["dtype"] == "bfloat16"
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("weights/engines")] == [2.0, 2.0]
    assert [e.value for e in events.Scalars("actor/update_ok")] == [1.0, 1.0]
    gaps = [e.value for e in events.Scalars("weights/logprob_mismatch_max")]
    limit = default_mismatch_limit("bfloat16")
    assert len(gaps) == 2 and all(1e-4 < gap < limit for gap in gaps), (gaps, limit)
    # the rollout's tokens are trained against the distribution they were sampled from, within bf16 numerics (raw
    # engine logprobs at temperature 0.7 sat 0.24 away)
    assert all(e.value < 0.02 for e in events.Scalars("rollout/actor_logprob_diff_mean"))
    # IcePop: a share of the trained tokens masked (weight 0), the others weighted by an r inside the band, so the
    # mean weight over all of them lies between (1 - masked) x low and (1 - masked) x high
    masked = [e.value for e in events.Scalars("actor/correction_masked_fraction")]
    weights = [e.value for e in events.Scalars("actor/tis_weight_mean")]
    assert len(masked) == len(weights) == 2 and all(share < 1 for share in masked) and masked[1] > 0, masked
    for share, weight in zip(masked, weights):
        assert (1 - share) * ICEPOP_LOW - 1e-6 <= weight <= (1 - share) * ICEPOP_HIGH + 1e-6, (share, weight)
