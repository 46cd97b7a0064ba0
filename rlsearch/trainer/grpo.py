"""The GRPO training loop (Ray driver): rollout -> reward -> advantages -> train -> weight sync -> log.

`GRPOTrainer` owns the loop and the step; start-up is startup.py's, choosing, saving and loading checkpoints
checkpoints.py's, what to do when a worker dies recovery.py's, carrying it out (and the weight sync, the probe check,
checkpoints and resumes) rollout_side.py's and actor_side.py's, and what a step logs step_log.py's."""

from __future__ import annotations

import time
from pathlib import Path

from ..actor import TrainSample
from ..checkpoint import CheckpointStore
from ..config import EvalConfig, TrainConfig, resolve_store_dirs
from ..data import QAExample
from ..eval import evaluate
from ..reward import score_trajectories, score_turns
from ..reward.evolving import RubricBuffer
from ..rollout import NoEngineLeftError, Trajectory
from ..runlog import RunSummary, format_step_line, plot_run
from .actor_side import ActorSide
from .checkpoints import checkpoint_to_resume
from .estimates import token_estimates
from .mismatch_gate import check_rollout_mismatch
from .progress import RunParts, RunProgress
from .recovery import WorkerDiedError, dead_workers, is_ray_error
from .rollout_side import RolloutSide
from .rollouts import PendingRollout, RolloutQueue
from .sampler import EpochSampler, SamplerState
from .skip_guard import SkipGuard
from .startup import load_and_check, start_run, startup_line
from .step_batch import TURN_CREDIT, StepBatch, overlong_masked, select_groups, token_series_of, train_samples
from .step_log import log_step, new_logger, prints_step, run_metrics
from .timing import timed
from .update import PolicyUpdate, critic_update, policy_update


class GRPOTrainer:
    def __init__(self, config: TrainConfig) -> None:
        self.config = config = resolve_store_dirs(config, config.trainer.output_dir)  # tool and judge stores go there
        self.output_dir = Path(config.trainer.output_dir)
        self.parts = RunParts(CheckpointStore(self.output_dir, keep=config.trainer.keep_checkpoints))
        # a trainer.resume dir that is no complete run checkpoint stops the run here, before anything starts
        self.resume_point = checkpoint_to_resume(config, self.parts.checkpoints)
        self.examples = load_and_check(config)
        self.sampler = EpochSampler(self.examples, seed=config.trainer.seed, shuffle=config.data.shuffle)
        self.rollouts = RolloutQueue(self.sampler)
        # the step, the data position, the steps skipped for a NaN/inf loss or grad norm, the restart counters
        self.progress = RunProgress(sampler=self.sampler, skip_guard=SkipGuard(config.trainer.max_consecutive_skips))
        evolve = config.reward.rubric.evolve
        if evolve.enabled:
            self.progress.rubrics = RubricBuffer(evolve.max_active_rubrics,
                                                 evolve.use_static_rubrics_as_persistent_rubrics)
        self._start_actor = None  # new actor ranks, once the run started
        self._start_critic = None  # and new critic ranks beside them (algo.advantage=gae)

    @property
    def rollout_side(self) -> RolloutSide:
        """The engines' weight syncs, probe checks and restarts (and the tool servers' revival)."""
        return RolloutSide(self.config, self.parts, self.progress, self.rollouts)

    @property
    def actor_side(self) -> ActorSide:
        """The actor state's checkpoints and resumes, the skipped-step stop, and dead actor ranks replaced."""
        return ActorSide(self.config, self.parts, self.progress, self.rollout_side, self._start_actor,
                         self._start_critic)

    def _start(self) -> None:
        started = start_run(self.config, self.examples, self.parts, self.output_dir)
        self.config, self._start_actor, self._start_critic = started.config, started.start_actor, started.start_critic
        if self.resume_point is not None:
            with timed(started.seconds, "resume"):
                self.actor_side.resume(self.resume_point)
            self.progress.resumed_step = self.resume_point.step
        elif self.parts.pool.adopted:  # engines taken over from a dead driver hold its later weights
            self.rollout_side.sync()
        print(startup_line(started.seconds), flush=True)
        self.parts.logger = new_logger(self.config, self.output_dir, self.progress.resumed_step)

    def close(self, graceful: bool = True) -> None:
        self.parts.stop(graceful)

    # ---- the loop -------------------------------------------------------------------------------------

    def train(self) -> RunSummary:
        died: list[str] = []
        try:
            return self._train_to_the_last_step()
        except WorkerDiedError as error:
            died = error.dead
            raise
        except Exception as error:
            # a Ray call failed, or the rollout lost its last engine: name the actors that died
            named = is_ray_error(error) or isinstance(error, NoEngineLeftError)
            died = dead_workers(self.parts.pool, self.parts.actor, critic=self.parts.critic) if named else []
            if died:
                raise WorkerDiedError(self.rollout_side.died_message(died, error), died) from error
            raise
        finally:
            self.close(graceful=not died)

    def _train_to_the_last_step(self) -> RunSummary:
        started = time.perf_counter()
        self._start()
        metrics = self.check_parity()
        print(f"[rlsearch] engine vs actor logprobs before training: max |diff| "
              f"{metrics['weights/logprob_mismatch_max']:.2e} ({self.parts.actor.spec.sampling.describe()})",
              flush=True)
        last_checkpoint = None
        history: dict[int, dict[str, float]] = {}  # step -> its metrics (a step trained again replaces them)
        if self.progress.step >= self.config.trainer.total_steps:
            print(f"[rlsearch] the run is already at step {self.progress.step} of trainer.total_steps="
                  f"{self.config.trainer.total_steps}: nothing to train. Raise trainer.total_steps to continue, "
                  "or set trainer.resume=none to start over", flush=True)
        while self.progress.step < self.config.trainer.total_steps:
            try:
                metrics, checkpoint = self._run_step()
            except Exception as error:
                # raises `error` unless actor ranks died and can be replaced; then the run rewound
                self.actor_side.replace_dead_ranks(error)
                history = {step: logged for step, logged in history.items() if step <= self.progress.step}
                continue
            history[self.progress.step] = metrics
            last_checkpoint = checkpoint or last_checkpoint
        return RunSummary(
            output_dir=self.output_dir, tensorboard_dir=self.parts.logger.tensorboard_dir,
            trajectory_dir=self.parts.logger.trajectory_dir if self.config.trainer.log_trajectories else None,
            checkpoint=last_checkpoint, steps=self.progress.step, seconds=time.perf_counter() - started,
            last_metrics=metrics, resumed_step=self.progress.resumed_step, curves=plot_run(self.output_dir),
            history=list(history.values()),
        )

    def _run_step(self) -> tuple[dict[str, float], Path | None]:
        """The next step, its progress line, then a checkpoint and an eval when they are due: (metrics, checkpoint)."""
        self.progress.step += 1
        step, trainer = self.progress.step, self.config.trainer
        # 1. generate: this step's rollout (and the next ones, up to rollout.async_steps ahead) submitted
        self.rollout_side.revive_tool_servers()
        self.rollouts.launch(self.config, self.parts.pool, self.progress)
        # 2. train on it, the new weights synced into the engines (grpo_step)
        metrics = self.grpo_step(self.rollouts.next())
        if prints_step(step, trainer.total_steps, trainer.print_interval):
            print(format_step_line(step, trainer.total_steps, metrics), flush=True)
        self.actor_side.record_skip(metrics)
        # 3. save, when due
        checkpoint = None
        if step == trainer.total_steps or (trainer.save_interval and step % trainer.save_interval == 0):
            checkpoint = self.actor_side.save_if_updated()
        # 4. eval, when due
        if trainer.eval_interval and (step % trainer.eval_interval == 0 or step == trainer.total_steps):
            self.evaluate_policy()
        return metrics, checkpoint

    def grpo_step(self, rollout: PendingRollout) -> dict[str, float]:
        """One training step on a submitted rollout, under algo.advantage (GRPO by default, PPO with the critic with
        gae); returns the step's metrics (also logged)."""
        timings, started, trained_version = {}, time.perf_counter(), self.progress.weight_version
        staleness = trained_version - rollout.weight_version  # as submitted, before step 1 may run it again
        self.progress.trained_sampler_state = rollout.sampler
        algo, critic = self.config.algo, self.parts.critic

        # 1. rollout: the step's trajectories (submitted up to rollout.async_steps steps ago)
        with timed(timings, "time/rollout_s"):
            trajectories: list[Trajectory] = self.rollout_side.trajectories(rollout)

        # 2. reward: every trajectory scored against its example (judge calls concurrently)
        with timed(timings, "time/reward_s"):
            reward_stats = self._score(trajectories, rollout.examples)

        # 3. algo: the groups to train (algo.filter_groups, data.batch_size), their samples with an advantage per
        # trajectory (algo.advantage) and token weights
        with timed(timings, "time/algo_s"):
            batch = select_groups(trajectories, algo, self.config.data.batch_size)
            samples = self._samples_to_train(rollout.step, trajectories, batch)

        # 4. actor: reference logprobs for the KL penalty (algo.kl_coef)
        with timed(timings, "time/ref_logprob_s"):
            self._add_reference_logprobs(samples)

        # 5. critic: its values of the samples' tokens (algo.advantage=gae); with critic.offload the actor waits in
        # host memory during the critic's turn, and the critic during the rest of the step (each comes back on use)
        values = None
        if critic is not None and samples:
            with timed(timings, "time/values_s"):
                if self.config.critic.offload:
                    self.parts.actor.offload()
                values = critic.compute_values(samples)

        # 6. algo: per-token advantages (gae from the values, reinforce_pp's returns), whitened over the step
        estimates = token_estimates(batch.trajectories, samples, algo, values)

        # 7. critic: its value-loss updates towards the returns
        critic_metrics = {}
        if values is not None:
            with timed(timings, "time/critic_s"):
                critic_metrics = critic_update(critic, samples, algo, self.config.critic)
                if self.config.critic.offload:
                    critic.offload()

        # 8. actor: the policy update, algo.ppo_epochs x algo.num_minibatches optimizer steps (none while the critic
        # warms up, critic.warmup_steps); the mismatch gate
        with timed(timings, "time/train_s"):
            update = policy_update(self.parts.actor, samples, algo) if samples and not self._critic_warming_up() \
                else None
        self._check_mismatch(update)

        # 9. weights: the engines get the new weights (none when nothing changed) and must match the actor
        changed = update is not None and update.changed_weights
        self.progress.weights_updated |= changed
        sync_metrics = self.rollout_side.sync_new_weights(changed, timings)

        # 10. log
        return log_step(self.parts.logger, self.progress.step, rollout, trajectories, trained_version, {
            **reward_stats, **batch.metrics(),
            "rollout/overlong_masked": float(overlong_masked(batch.trajectories, algo)),
            # the critic's explained variance and mean value: of the values the advantages came from (estimates)
            **critic_metrics, **estimates,
            **(update.metrics if update else {"actor/updates": 0.0}), **sync_metrics,
            **run_metrics(self.parts.pool, self.progress, rollout.step, update, staleness),
        }, token_series_of(batch.trajectories, samples), timings, started)

    def _critic_warming_up(self) -> bool:
        """Whether this step trains the critic only (critic.warmup_steps): the actor and the engines wait."""
        return self.parts.critic is not None and self.progress.step <= self.config.critic.warmup_steps

    def _score(self, trajectories: list[Trajectory], group_examples: list[QAExample]) -> dict[str, float]:
        """Rewards of the trajectories (and, with turn-level credit, of every model turn) against their examples
        (`group_examples[group_id]`), the evolving rubrics grown with them (reward.rubric.evolve); returns the reward
        stats."""
        examples = [group_examples[t.group_id] for t in trajectories]
        reward_stats = score_trajectories(trajectories, examples, self.config.reward, self.progress.rubrics,
                                          self.progress.step)
        if self.config.algo.advantage in TURN_CREDIT:  # turn-level credit: a reward for every model turn
            reward_stats.update(score_turns(trajectories, examples, self.config.reward))
        return reward_stats

    def _samples_to_train(self, step: int, trajectories: list[Trajectory], batch: StepBatch) -> list[TrainSample]:
        """The step's train samples; none (and a line saying why) when algo.filter_groups dropped every group. Raises
        when every trajectory failed in the user agent (a broken agent, not a data property)."""
        if all(t.failed for t in trajectories):
            raise RuntimeError(
                f"every trajectory of step {step} failed (the agent {self.config.rollout.agent}, or the reward judge) "
                f"and none can be trained on; the first: {trajectories[0].failed}"
            )
        if not batch.trajectories:
            print(f"[rlsearch] step {self.progress.step}: all {batch.groups_dropped} groups had the same outcome for "
                  f"every sample ({batch.describe_dropped()}): nothing to learn from, no update", flush=True)
            return []
        return train_samples(batch.trajectories, self.config.algo)

    def _add_reference_logprobs(self, samples: list[TrainSample]) -> None:
        if samples and self.config.algo.kl_coef > 0:
            for sample, logprobs in zip(samples, self.parts.actor.compute_logprobs(samples, reference=True)):
                sample.ref_logprobs = logprobs

    def _check_mismatch(self, update: PolicyUpdate | None) -> None:
        """The mismatch gate (algo.mismatch_threshold): a warning line, or the run stops before the sync."""
        algo = self.config.algo
        if update is not None and (line := check_rollout_mismatch(
                self.progress.step, update.metrics, algo.mismatch_threshold, algo.mismatch_action)):
            print(f"[rlsearch] {line}", flush=True)

    def save_checkpoint(self, step: int | None = None, sampler: SamplerState | None = None) -> Path:
        """The actor state as the checkpoint of `step` (default: the current step) with the data position `sampler`
        (default: after the last trained batch)."""
        return self.actor_side.save_checkpoint(step, sampler)

    def evaluate_policy(self) -> dict[str, float]:
        """Score the current policy on eval.files through the eval-only code path, with this run's engines."""
        config = self.config
        eval_config = EvalConfig(
            model=config.model, eval=config.eval, rollout=config.rollout, reward=config.reward, tools=config.tools,
            output_dir=str(self.output_dir / "eval" / f"step_{self.progress.step:06d}"),
        )
        summary = evaluate(self.parts.pool.generate, eval_config)
        scalars = summary.scalars()
        self.parts.logger.log_metrics(self.progress.step, scalars)
        overall = summary.metrics.get("overall", {})
        print(f"[rlsearch] eval after step {self.progress.step}: EM {overall.get('em', 0):.3f}, "
              f"F1 {overall.get('f1', 0):.3f} ({summary.output_dir})", flush=True)
        return scalars

    def check_parity(self) -> dict[str, float]:
        """Every engine and the actor score the probe sequence; abort when one disagrees (stale or corrupt weights)."""
        return self.rollout_side.check_parity()
