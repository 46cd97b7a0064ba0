"""The actor side of a run as the trainer keeps it going: the actor state saved as a run checkpoint (when due, or of
the last good step when NaN/inf steps stop the run), a resume from one, and dead actor ranks replaced with the run
rewound to its newest checkpoint. recovery.py decides (`RestartPolicy.step_failed`), `ActorSide` carries it out;
checkpoints.py chooses, saves and loads the checkpoints.

It may call the actor ranks (shutdown, and the factory of new ones startup.py returned), the weight sync's senders,
the rollouts in flight and the run's logger; the engines' side of a rewind is rollout_side.py's."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .checkpoints import ResumePoint, load_actor_state, load_critic_state, newest_own_checkpoint, save_run_checkpoint
from .recovery import Action, WorkerDiedError, dead_workers, is_ray_error
from .sampler import SamplerState
from .skip_guard import NonFiniteStepsError
from .step_log import new_logger

if TYPE_CHECKING:
    from ..actor import ActorRanks, CriticRanks
    from ..config import TrainConfig
    from .progress import RunParts, RunProgress
    from .rollout_side import RolloutSide


@dataclass
class ActorSide:
    config: TrainConfig
    parts: RunParts
    progress: RunProgress
    rollout_side: RolloutSide
    start_actor: Callable[[], ActorRanks] | None = None  # new actor ranks (startup.start_run's factory)
    start_critic: Callable[[ActorRanks], CriticRanks] | None = None  # new critic ranks beside them (with a critic)

    def save_checkpoint(self, step: int | None = None, sampler: SamplerState | None = None) -> Path:
        """The actor state as the checkpoint of `step` (default: the current step) with the data position `sampler`
        (default: after the last trained batch)."""
        step = self.progress.step if step is None else step
        sampler = self.progress.trained_sampler_state if sampler is None else sampler
        path = save_run_checkpoint(self.config, self.parts.actor, self.parts.checkpoints, step, sampler,
                                   self.parts.critic, self.progress.rubrics)
        self.progress.saved_checkpoints[step] = path
        return path

    def save_if_updated(self) -> Path | None:
        """A checkpoint of the current step, unless no step has updated the weights yet (algo.filter_groups dropped
        every group so far): the weights are still model.path's and the optimizer has no state to save."""
        if not self.progress.weights_updated:
            print(f"[rlsearch] no checkpoint after step {self.progress.step}: no step has updated the weights yet, "
                  f"they are model.path's ({self.config.model.path})", flush=True)
            return None
        return self.save_checkpoint()

    def checkpoint_of_step(self, step: int, sampler: SamplerState) -> Path:
        """A checkpoint whose trainer state is `step`: the one this process saved (or resumed from) then, or a new one
        of the current actor state, which is that step's when every step since was skipped."""
        saved = self.progress.saved_checkpoints.get(step)
        if saved is not None and saved.is_dir():
            print(f"[rlsearch] the checkpoint of step {step} is {saved}", flush=True)
            return saved
        return self.save_checkpoint(step=step, sampler=sampler)

    def record_skip(self, metrics: dict[str, float]) -> None:
        """Count a step the actor skipped for a NaN/inf loss or grad norm; after trainer.max_consecutive_skips in a
        row, save the state of the last good step and stop with NonFiniteStepsError naming that checkpoint."""
        progress = self.progress
        skipped = metrics.get("actor/skipped_nonfinite", 0.0) > 0
        if skipped:
            limit = self.config.trainer.max_consecutive_skips
            loss = metrics.get("actor/policy_loss", float("nan"))
            print(f"[rlsearch] warning: step {progress.step}: loss {loss:.4g}, "
                  f"NaN/inf in the loss or gradients: optimizer step skipped, weights unchanged "
                  f"({len(progress.skip_guard.consecutive) + 1} in a row, stop at {limit or 'never'}; "
                  f"{progress.skip_guard.total + 1} skipped in total)", flush=True)
        else:
            progress.good_sampler_state = progress.trained_sampler_state
        try:
            progress.skip_guard.record(progress.step, skipped)
        except NonFiniteStepsError as error:
            if error.last_good_step and progress.weights_updated:
                error.checkpoint = self.checkpoint_of_step(error.last_good_step, progress.good_sampler_state)
            else:  # a fresh run that never updated: the model is model.path's and the optimizer has no state to save
                error.initial_model = self.config.model.path
            raise

    def resume(self, point: ResumePoint, version: int | None = None) -> None:
        """Actor state from the checkpoint (resharded into this run's layout), then the engine gets those weights (as
        policy version `version`, default the current one); the step counter, data order and sampling seeds
        continue where the checkpoint left them."""
        resharded = load_actor_state(self.parts.actor, point, self.config.actor.layout)
        if self.parts.critic is not None:
            resharded += load_critic_state(self.parts.critic, point)
        self.progress.rewind(point.step, point.sampler, point.rubrics)
        self.progress.weights_updated = True
        self.progress.saved_checkpoints[point.step] = point.path
        sync = self.rollout_side.sync(version)
        print(f"[rlsearch] resumed from {point.path} after step {self.progress.step}{resharded}; weights synced to the "
              f"engine in {sync.seconds:.1f} s", flush=True)

    def rewind_to_newest_checkpoint(self) -> ResumePoint | None:
        """The run rewinds to the newest checkpoint this process saved or resumed from, the engines getting its
        weights as a new policy version; returns it (None: none yet)."""
        point = newest_own_checkpoint(self.config, self.progress.saved_checkpoints)
        version = self.progress.weight_version + 1  # the engines get other weights than the ones they sampled with
        if point is not None:
            self.resume(point, version)
        else:  # no checkpoint yet: the new ranks hold model.path's weights, and the run starts over
            self.progress.rewind(0, SamplerState())
            self.progress.weights_updated = False
            self.rollout_side.sync(version)
        return point

    def replace_dead_ranks(self, error: Exception) -> None:
        """After a step failed: when actor (or critic) ranks died and nothing else did, every rank is replaced (a
        Megatron group cannot take one new rank; the critic's go with the actor's) and the run rewinds to its newest
        complete checkpoint, or to the start before the first; the rollout engines and tool servers stay up, and the
        engines get the checkpoint's weights. The steps after the checkpoint are trained again (their trajectory
        records replaced), from the same prompts. Re-raises `error` otherwise, and a WorkerDiedError after
        trainer.max_actor_restarts replacements."""
        ray_error, policy = is_ray_error(error), self.rollout_side.restart_policy
        dead = dead_workers(self.parts.pool, self.parts.actor, critic=self.parts.critic) if ray_error else []
        # the critic's ranks are replaced with the actor's (they share its placement group)
        ranks = {name for group in (self.parts.actor, self.parts.critic) if group is not None
                 for name, _ in group.named_workers()}
        verdict = policy.step_failed(ray_error, dead, ranks, self.progress.actor_restarts)
        if verdict.action is Action.RERAISE:
            raise error
        if verdict.action is Action.STOP:
            raise WorkerDiedError(self.rollout_side.died_message(dead, error) + verdict.limit_note, dead) from error
        started, failed_step = time.perf_counter(), self.progress.step
        self.progress.actor_restarts += 1
        if self.parts.critic is not None:  # its ranks are in the actor's placement group: replaced with them
            self.parts.critic.shutdown(graceful=False)
            self.parts.critic = None
        self.parts.actor.shutdown(graceful=False)
        self.parts.actor = None  # a failed start leaves nothing for close() to stop
        self.parts.actor = self.start_actor()
        if self.start_critic is not None:
            self.parts.critic = self.start_critic(self.parts.actor)
        self.parts.weight_sync.replace_senders(self.parts.actor)
        self.rollout_side.rollouts.drop(self.parts.pool.group_timeout_s)
        point = self.rewind_to_newest_checkpoint()
        self.parts.logger.close()  # a new logger drops the TensorBoard points of the steps trained again
        self.parts.logger = new_logger(self.config, Path(self.config.trainer.output_dir), self.progress.step)
        self.rollout_side.check_parity()
        since = point.path if point else "no checkpoint yet: from model.path"
        print(f"[rlsearch] {' and '.join(dead)} died during step {failed_step}: the actor ranks were replaced "
              f"({self.progress.actor_restarts} of trainer.max_actor_restarts={policy.actor_restarts}) and the run "
              f"continues after step {self.progress.step} ({since}), {time.perf_counter() - started:.1f} s; the "
              "rollout engines stayed up", flush=True)
