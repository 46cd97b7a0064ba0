"""Two rollout engines, each killed with SIGKILL once in one run: one in the middle of the first weight sync (after
step 1), the other during step 2's rollout. The sync fails, the engine is restarted and the sync runs again into
every engine; the rollout completes on the surviving engine (the dead engine's groups run again there) and the dead
engine is restarted and synced before the next rollout. The run trains to the end with every engine passing the
probe check after every sync. (One engine dying during a sync, with no survivor beside it:
test_engine_dies_during_sync.py.)"""

from __future__ import annotations

import re

from tests.drivers import train_command
from tests.faults.kills import first_sync_started, printed, run_killing_engines

STEPS = 3  # the step the sync after which an engine dies, the step whose rollout loses one, and one more


def test_engines_killed_during_a_sync_and_during_a_rollout_are_replaced_and_the_run_goes_on(
    tmp_path, tiny_model_dir, toy_data, driver_ray
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, log_path = tmp_path / "run", tmp_path / "train.log"
    # a random model earns no reward; the k1 KL term changes the weights every step, so every step syncs
    command = train_command(tiny_model_dir, toy_data, tmp_path / "bm25", run_dir, "rollout.num_engines=2",
                            "rollout.groups_per_engine=1", "data.batch_size=4", f"trainer.total_steps={STEPS}",
                            "trainer.save_interval=0", "weights.transport=shm", "algo.kl_coef=0.1",
                            "algo.kl_estimator=k1")
    # the first sync comes after step 1's update; step 2's rollout starts right after step 1's line
    returncode, output, killed = run_killing_engines(command, log_path, driver_ray, [
        first_sync_started(run_dir), printed(log_path, f"step 1/{STEPS} |")])
    assert returncode == 0, output[-3000:]
    assert len(set(killed)) == 2
    for step in range(1, STEPS + 1):
        assert f"step {step}/{STEPS} | reward" in output
    assert "died; its groups ran on the others" in output
    assert output.count("restarted rollout engine") == 2, output[-3000:]
    # the driver's start-up, phase by phase (what a driver restart costs)
    assert re.search(r"\[rlsearch\] started in [\d.]+ s: tool servers [\d.]+, Ray [\d.]+, rollout engines [\d.]+ and "
                     r"actor ranks [\d.]+ side by side \([\d.]+\), the rest \(imports, data, checks\) [\d.]+$", output,
                     re.MULTILINE), output[:3000]

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    # step 2's rollout lost an engine: its groups ran again on the other; no other rollout did
    assert [e.value >= 1 for e in events.Scalars("rollout/redispatched_groups")] == [False, True, False]
    restarts = [e.value for e in events.Scalars("rollout/engine_restarts_total")]
    assert restarts[0] == 1.0 and restarts[-1] == 2.0 and restarts == sorted(restarts)
    assert [e.value for e in events.Scalars("weights/engines")] == [2.0] * STEPS  # every sync reached both
    # every group of the step after the last restart ran, on both engines again
    per_engine = [events.Scalars(f"rollout/engine{engine}/groups")[STEPS - 1].value for engine in (0, 1)]
    assert sum(per_engine) == 4 and min(per_engine) >= 1, per_engine
    # the probe check covers every engine after every sync, the restarted ones included
    assert max(e.value for e in events.Scalars("weights/logprob_mismatch_max")) < 1e-4
