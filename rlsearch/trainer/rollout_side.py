"""The rollout side of a run as the trainer keeps it going: the actor's weights synced into the engines (as a policy
version) and checked against the actor on the probe sequence; the engines that died restarted, a rollout on which
every engine died run again, a sync during which one died run again once, and the local tool servers that died
started again. recovery.py decides (`RestartPolicy`), `RolloutSide` carries its verdicts out.

It may call the engine pool, the weight sync, the probe check (rlsearch.weights) and the tool servers' `revive`;
starting them is startup.py's."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..rollout import NoEngineLeftError
from ..weights import SyncStats, WeightSyncError, check_engines_match_actor, default_mismatch_limit
from .recovery import Action, RestartPolicy, Verdict, WorkerDiedError, died_message
from .timing import timed

if TYPE_CHECKING:
    from ..config import TrainConfig
    from ..rollout import Trajectory
    from .progress import RunParts, RunProgress
    from .rollouts import PendingRollout, RolloutQueue

NO_SYNC = {"time/sync_s": 0.0, "weights/buckets": 0.0, "weights/engines": 0.0, "weights/sync_mib": 0.0}


@dataclass
class RolloutSide:
    config: TrainConfig
    parts: RunParts
    progress: RunProgress
    rollouts: RolloutQueue

    @property
    def restart_policy(self) -> RestartPolicy:
        return RestartPolicy.of(self.config)

    def sync(self, version: int | None = None) -> SyncStats:
        """The actor's weights into every engine as policy version `version` (default: the current one), the label
        of what they sample from them; progress.weight_version is that version once the sync finished."""
        version = self.progress.weight_version if version is None else version
        sync = self.parts.weight_sync.sync(self.parts.pool.engines, version)
        self.progress.weight_version = version
        return sync

    def check_parity(self) -> dict[str, float]:
        """Every engine and the actor score the probe sequence; abort when one disagrees (stale or corrupt weights)."""
        limit = self.config.weights.max_logprob_mismatch
        if limit is None:
            limit = default_mismatch_limit(self.config.model.dtype)
        parts = self.parts
        return check_engines_match_actor(parts.actor, parts.pool.engines, parts.probe_ids, limit, self.progress.step)

    def sync_new_weights(self, changed: bool, timings: dict[str, float]) -> dict[str, float]:
        """New weights into every engine, then the probe check; returns the sync's metrics. Without new weights (no
        update, or every update skipped for NaN/inf) the engines keep theirs, unless one was restarted: it starts
        from the weights on disk."""
        with timed(timings, "time/rollout_s"):
            if changed and self.rollouts and not self.config.rollout.update_weights_in_flight:
                # rollouts already submitted finish with the weights they were submitted under
                self.rollouts.wait()
        restarted = self.replace_dead_engines().action is Action.REPLACE
        if not (changed or restarted):
            return dict(NO_SYNC)
        version = self.progress.weight_version + changed
        try:
            sync = self.sync(version)
        except WeightSyncError:
            # an engine that died during the sync is replaced, and the sync (which forms its broadcast groups anew)
            # runs again once; the engines that lived stayed paused, so nothing sampled from half-loaded weights
            if self.replace_dead_engines().action is Action.RERAISE:
                raise
            sync = self.sync(version)
        probe_started = time.perf_counter()
        parity = self.check_parity()
        return {
            **parity,
            "time/sync_s": sync.seconds,
            "weights/buckets": float(sync.num_buckets),
            "weights/engines": float(sync.num_engines),
            "weights/sync_mib": sync.num_bytes / 2**20,
            "weights/wire_mib": sync.wire_bytes / 2**20,  # what the buckets took: less than sync_mib for a delta
            "weights/delta": float(sync.delta),
            # where the sync's seconds went (rlsearch.weights.clock.PHASES), and the probe check after it
            **{f"weights/time/{phase}": seconds for phase, seconds in sync.phases.items()},
            "weights/time/probe": time.perf_counter() - probe_started,
            "weights/pause_s": sync.phases.get("pause", 0.0),  # how long the engines stood still
        }

    def trajectories(self, rollout: PendingRollout) -> list[Trajectory]:
        """The rollout's trajectories. When every engine died during it, the engines are restarted, given the current
        weights (a restarted engine starts from model.path's) and the rollout runs again on them (its seeds are per
        question, sample and turn), at most rollout.max_engine_restarts_per_step times. (With rollout.async_steps
        >= 1 the sync before this step may have restarted them already.)"""
        failures = 0
        while True:
            try:
                return rollout.trajectories.result()
            except NoEngineLeftError as error:
                failures += 1
                if self.restart_policy.rollout_lost_every_engine(failures).action is Action.RERAISE:
                    raise
                self.replace_dead_engines()
                print(f"[rlsearch] every rollout engine died during the rollout of step {rollout.step} ({error}); "
                      "they were restarted and synced, and the rollout runs again", flush=True)
            self.sync()
            self.check_parity()
            rollout.weight_version = self.progress.weight_version
            rollout.trajectories = self.parts.pool.submit(rollout.items, rollout.step)

    def replace_dead_engines(self) -> Verdict:
        """Restart the rollout engines that died (REPLACE; RERAISE: none died). More than
        rollout.max_engine_restarts_per_step in one step stop the run (WorkerDiedError, naming the engines and the
        last checkpoint)."""
        dead = self.parts.pool.dead_engines()
        restarts = self.progress.restarts_by_step.get(self.progress.step, 0)
        verdict = self.restart_policy.engines_died(len(dead), restarts)
        if verdict.action is Action.STOP:
            names = [f"rollout engine {index}" for index in dead]
            raise WorkerDiedError(self.died_message(names) + verdict.limit_note, names)
        if verdict.action is Action.REPLACE:
            self.progress.restarts_by_step = {self.progress.step: restarts + len(dead)}
        for index in dead:
            self.parts.pool.restart(index)
            print(f"[rlsearch] restarted rollout engine {index}, which died; the current weights are synced into it "
                  "before the next rollout", flush=True)
        self.progress.engine_restarts += len(dead)
        return verdict

    def revive_tool_servers(self) -> None:
        """A local tool server that died is started again before the next rollout is submitted (the calls that met
        it dead are error observations, counted in rollout/tool_errors)."""
        if self.parts.tool_servers is not None:
            for line in self.parts.tool_servers.revive():
                print(f"[rlsearch] {line}", flush=True)

    def died_message(self, dead: list[str], error: BaseException | None = None) -> str:
        """recovery.died_message at the current step, naming the run's last complete checkpoint."""
        checkpoint, _ = self.parts.checkpoints.newest_complete()
        return died_message(dead, self.progress.step, checkpoint, self.config.trainer.save_interval, error)
