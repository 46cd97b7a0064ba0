"""A rollout engine killed with SIGKILL in the middle of a weight sync (the first one, after step 1), with one engine
and with two: the sync fails, the engine is restarted, the sync runs again into every engine, and the run trains to
the end with every engine passing the probe check after every sync."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from rlsearch.weights.shm import SENDER_FILE_PREFIX, STAGING_DIR
from tests.faults.test_killed_engine import run_killing_an_engine
from tests.faults.test_killed_worker import _command

STEPS = 3


def _sender_files() -> set[Path]:
    return set(Path(STAGING_DIR).glob(f"{SENDER_FILE_PREFIX}{socket.gethostname()}-*"))


@pytest.mark.parametrize("engines", [1, 2], ids=["one-engine", "two-engines"])
def test_an_engine_that_dies_during_a_sync_is_restarted_and_synced(tmp_path, tiny_model_dir, toy_data, engines):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, log_path = tmp_path / "run", tmp_path / "train.log"
    # a random model earns no reward; the k1 KL term changes the weights every step, so every step syncs
    command = _command(tiny_model_dir, toy_data, tmp_path / "bm25", run_dir, f"rollout.num_engines={engines}",
                       f"trainer.total_steps={STEPS}", "trainer.save_interval=0", "weights.transport=shm",
                       "algo.kl_coef=0.1", "algo.kl_estimator=k1")
    before = _sender_files()
    # the actor's sender writes its first bucket file when the first sync (after step 1's update) starts
    returncode, output = run_killing_an_engine(command, log_path, lambda: bool(_sender_files() - before))
    assert returncode == 0, output[-3000:]
    assert output.count("restarted rollout engine") == 1, output[-3000:]
    for step in range(1, STEPS + 1):
        assert f"step {step}/{STEPS} | reward" in output

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("rollout/engine_restarts_total")] == [1.0] * STEPS
    assert [e.value for e in events.Scalars("weights/engines")] == [float(engines)] * STEPS
    # every engine, the restarted one included, samples from the weights the actor trained, after every sync
    assert max(e.value for e in events.Scalars("weights/logprob_mismatch_max")) < 1e-4
