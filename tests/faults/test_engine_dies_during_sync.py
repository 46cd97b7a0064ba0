"""The only rollout engine killed with SIGKILL in the middle of a weight sync (the first one, after step 1): the sync
fails, the engine is restarted, the sync runs again into it, and the run trains to the end with the engine passing
the probe check after every sync. (Two engines, one dying during a sync and the other during a rollout:
test_killed_engine.py.) The run starts its own Ray and engine: an engine taken over from an earlier driver would
be synced before step 1, and its sender's files, which show the first sync starting, would be there already."""

from __future__ import annotations

from tests.drivers import train_command
from tests.faults.kills import first_sync_started, run_killing_engines
from tests.faults.processes import logged_processes

STEPS = 3


def test_the_only_engine_dying_during_a_sync_is_restarted_and_synced(tmp_path, tiny_model_dir, toy_data):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, log_path = tmp_path / "run", tmp_path / "train.log"
    # a random model earns no reward; the k1 KL term changes the weights every step, so every step syncs
    command = train_command(tiny_model_dir, toy_data, tmp_path / "bm25", run_dir, f"trainer.total_steps={STEPS}",
                            "trainer.save_interval=0", "weights.transport=shm", "algo.kl_coef=0.1",
                            "algo.kl_estimator=k1")
    # the first sync comes after step 1's update
    returncode, output, _ = run_killing_engines(command, log_path, {}, [first_sync_started(run_dir)],
                                                lambda: {str(process.pid): process for process in logged_processes(
                                                    run_dir, "rollout-engine", "RolloutWorker")})
    assert returncode == 0, output[-3000:]
    assert output.count("restarted rollout engine") == 1, output[-3000:]
    for step in range(1, STEPS + 1):
        assert f"step {step}/{STEPS} | reward" in output

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("rollout/engine_restarts_total")] == [1.0] * STEPS
    assert [e.value for e in events.Scalars("weights/engines")] == [1.0] * STEPS
    # the engine, restarted, samples from the weights the actor trained, after every sync
    assert max(e.value for e in events.Scalars("weights/logprob_mismatch_max")) < 1e-4
