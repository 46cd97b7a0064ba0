"""A sync that fails because an engine died during it (a broadcast past its deadline: on nccl as on gloo, see
tests/integration/test_gpu_stack_broadcast_timeout.py) runs the engine-restart path: the dead engine is replaced and
the sync runs again, once. A sync that fails with every engine alive stops the run. A rollout on which every engine
died runs again on restarted, synced engines. The trainer's bookkeeping alone,
with stand-ins for the pool and the weight path (a real engine dying before a sync: test_weight_fanout.py)."""

from __future__ import annotations

import pytest

from rlsearch.checkpoint import CheckpointStore
from rlsearch.config import load_train_config
from rlsearch.trainer.progress import RunParts, RunProgress
from rlsearch.trainer.rollout_side import RolloutSide
from rlsearch.weights import SyncStats, WeightSyncError


class Pool:
    def __init__(self) -> None:
        self.engines = ["engine 0", "engine 1"]
        self.died_in_sync = False  # engine 1 died during the failed sync
        self.restarted: list[int] = []

    def dead_engines(self) -> list[int]:
        return [1] if self.died_in_sync and 1 not in self.restarted else []

    def restart(self, index: int) -> str:
        self.restarted.append(index)
        self.engines[index] = f"engine {index} (restarted)"
        return self.engines[index]


class Sync:
    """Its first sync fails, engine 1 having died during it when `engine_dies`; the next ones succeed."""

    def __init__(self, pool: Pool, engine_dies: bool) -> None:
        self.pool, self.engine_dies = pool, engine_dies
        self.failed = False
        self.synced: list[list[str]] = []
        self.versions: list[int | None] = []  # the policy version each sync gave the engines

    def sync(self, engines, version: int | None = None) -> SyncStats:
        if not self.failed:
            self.failed = True
            self.pool.died_in_sync = self.engine_dies
            raise WeightSyncError("weight sync: broadcasting stage 0's weights did not finish (waiting on engine 1)")
        self.synced.append(list(engines))
        self.versions.append(version)
        return SyncStats(seconds=0.5, num_buckets=3, num_tensors=10, num_bytes=2**20, num_engines=len(engines))


def _trainer(dies: bool) -> RolloutSide:
    """The trainer's rollout side (trainer/rollout_side.py) on the stand-ins."""
    pool = Pool()
    parts = RunParts(CheckpointStore("/nonexistent"), pool=pool, weight_sync=Sync(pool, engine_dies=dies))
    trainer = RolloutSide(load_train_config(None, []), parts, RunProgress(step=1), rollouts=[])
    trainer.check_parity = lambda: {"weights/logprob_mismatch_max": 1e-6}
    return trainer


def test_an_engine_that_died_during_a_sync_is_restarted_and_synced(capsys) -> None:
    trainer = _trainer(dies=True)
    metrics = trainer.sync_new_weights(changed=True, timings={})
    assert trainer.parts.pool.restarted == [1] and trainer.progress.engine_restarts == 1
    assert trainer.parts.weight_sync.synced == [["engine 0", "engine 1 (restarted)"]]
    assert metrics["weights/engines"] == 2.0 and trainer.progress.weight_version == 1
    assert trainer.parts.weight_sync.versions == [1]  # the engines label what they sample with the driver's version
    assert "restarted rollout engine 1, which died" in capsys.readouterr().out


def test_more_engine_restarts_in_a_step_than_allowed_stop_the_run(tmp_path) -> None:
    from rlsearch.trainer import WorkerDiedError

    trainer = _trainer(dies=True)
    trainer.config = load_train_config(None, ["rollout.max_engine_restarts_per_step=0"])
    trainer.parts.checkpoints = CheckpointStore(tmp_path)
    with pytest.raises(WorkerDiedError, match=r"rollout engine 1 died \(its process exited\) during step 1; the run "
                       r"stopped\. no checkpoint was saved yet .*rollout\.max_engine_restarts_per_step=0"):
        trainer.sync_new_weights(changed=True, timings={})
    assert trainer.parts.pool.restarted == []


def test_a_sync_that_fails_with_every_engine_alive_stops_the_run() -> None:
    trainer = _trainer(dies=False)
    with pytest.raises(WeightSyncError, match="waiting on engine 1"):
        trainer.sync_new_weights(changed=True, timings={})
    assert trainer.parts.pool.restarted == [] and trainer.progress.weight_version == 0


def test_a_rollout_on_which_every_engine_died_runs_again_on_restarted_synced_engines(capsys) -> None:
    from concurrent.futures import Future

    from rlsearch.rollout import NoEngineLeftError
    from rlsearch.trainer.rollouts import PendingRollout

    def future(result=None, error=None) -> Future:
        done = Future()
        done.set_exception(error) if error else done.set_result(result)
        return done

    trainer = _trainer(dies=False)
    trainer.parts.weight_sync.failed = True  # its syncs succeed
    trainer.parts.pool.died_in_sync = True  # engine 1 is dead until restarted
    submitted = []
    trainer.parts.pool.submit = lambda items, step: submitted.append((items, step)) or future(["trajectory"])
    rollout = PendingRollout(step=1, examples=[], trajectories=future(error=NoEngineLeftError("every engine died")),
                             items=["item"], weight_version=0, sampler=None)
    assert trainer.trajectories(rollout) == ["trajectory"]
    assert trainer.parts.pool.restarted == [1] and submitted == [(["item"], 1)]
    assert trainer.parts.weight_sync.synced == [["engine 0", "engine 1 (restarted)"]]
    assert "every rollout engine died during the rollout of step 1" in capsys.readouterr().out

    trainer = _trainer(dies=False)
    trainer.config = load_train_config(None, ["rollout.max_engine_restarts_per_step=0"])
    rollout.trajectories = future(error=NoEngineLeftError("every engine died"))
    with pytest.raises(NoEngineLeftError):  # no restart allowed: train() names the dead engine
        trainer.trajectories(rollout)
