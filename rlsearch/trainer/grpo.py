"""The GRPO training loop (Ray driver): rollout -> reward -> advantages -> train -> weight sync -> log.

`GRPOTrainer` owns the loop and the step; start-up is startup.py's, choosing, saving and loading checkpoints
checkpoints.py's, and what to do when a worker dies recovery.py's."""

from __future__ import annotations

import time
from pathlib import Path

from ..actor import TrainSample
from ..checkpoint import CheckpointStore
from ..config import EvalConfig, TrainConfig, resolve_store_dirs, to_dict
from ..data import QAExample
from ..eval import evaluate
from ..reward import score_trajectories, score_turns
from ..rollout import NoEngineLeftError, Trajectory
from ..runlog import RunLogger, RunSummary, format_step_line, plot_run
from ..weights import SyncStats, WeightSyncError, check_engines_match_actor, default_mismatch_limit
from .checkpoints import ResumePoint, checkpoint_to_resume, load_actor_state, newest_own_checkpoint, save_run_checkpoint
from .metrics import staleness_metrics, token_staleness, trajectory_metrics
from .mismatch_gate import check_rollout_mismatch
from .progress import RunParts, RunProgress
from .recovery import Action, RestartPolicy, Verdict, WorkerDiedError, dead_workers, died_message, is_ray_error
from .rollouts import PendingRollout, RolloutQueue
from .sampler import EpochSampler, SamplerState
from .skip_guard import NonFiniteStepsError, SkipGuard
from .startup import load_and_check, start_run, startup_line
from .step_batch import StepBatch, actor_logprobs_of, overlong_masked, select_groups, train_samples
from .timing import timed
from .update import PolicyUpdate, policy_update


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
        # steps skipped for a NaN/inf loss or grad norm
        self.skip_guard = SkipGuard(config.trainer.max_consecutive_skips)
        self.progress = RunProgress()

    @property
    def restart_policy(self) -> RestartPolicy:
        return RestartPolicy.of(self.config)

    # ---- set-up and resume ----------------------------------------------------------------------------

    def _start(self) -> None:
        started = start_run(self.config, self.examples, self.parts, self.output_dir)
        self.config, self._start_actor = started.config, started.start_actor
        if self.resume_point is not None:
            with timed(started.seconds, "resume"):
                self._resume(self.resume_point)
            self.progress.resumed_step = self.resume_point.step
        elif self.parts.pool.adopted:  # engines taken over from a dead driver hold its later weights
            self._sync_engines()
        print(startup_line(started.seconds), flush=True)
        self.parts.logger = self._new_logger(self.progress.resumed_step)

    def _new_logger(self, resumed_step: int) -> RunLogger:
        trainer = self.config.trainer
        return RunLogger(self.output_dir, trainer.log_trajectories, resumed_step=resumed_step, loggers=trainer.loggers,
                         config=to_dict(self.config), wandb_project=trainer.wandb_project,
                         wandb_run_name=trainer.wandb_run_name)

    def _resume(self, point: ResumePoint, version: int | None = None) -> None:
        """Actor state from the checkpoint (resharded into this run's layout), then the engine gets those weights (as
        policy version `version`, default the current one); the step counter, data order and sampling seeds
        continue where the checkpoint left them."""
        resharded = load_actor_state(self.parts.actor, point, self.config.actor.layout)
        self._rewind_progress(point.step, point.sampler)
        self.progress.weights_updated = True
        self.progress.saved_checkpoints[point.step] = point.path
        sync = self._sync_engines(version)
        print(f"[rlsearch] resumed from {point.path} after step {self.progress.step}{resharded}; weights synced to the "
              f"engine in {sync.seconds:.1f} s", flush=True)

    def _rewind_progress(self, step: int, sampler: SamplerState) -> None:
        """The run stands after `step` with the data position `sampler`: the next rollout is `step + 1`'s."""
        self.progress.step = step
        self.progress.next_rollout_step = step + 1
        self.sampler.restore(sampler)
        self.progress.trained_sampler_state = self.progress.good_sampler_state = sampler
        self.skip_guard = SkipGuard(self.config.trainer.max_consecutive_skips)
        self.skip_guard.last_good_step = step

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
            died = dead_workers(self.parts.pool, self.parts.actor) if named else []
            if died:
                raise WorkerDiedError(self._died_message(died, error), died) from error
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
                self._replace_dead_actor(error)  # raises `error` unless actor ranks died and can be replaced
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
        self._revive_tool_servers()
        self.rollouts.launch(self.config, self.parts.pool, self.progress)
        metrics = self.train_step(self.rollouts.next())
        step, last_step = self.progress.step, self.config.trainer.total_steps
        if self._prints_step(step):
            print(format_step_line(step, last_step, metrics), flush=True)
        self._record_skip(metrics)
        checkpoint = None
        interval = self.config.trainer.save_interval
        if step == last_step or (interval and step % interval == 0):
            checkpoint = self._checkpoint_if_updated()
        interval = self.config.trainer.eval_interval
        if interval and (step % interval == 0 or step == last_step):
            self.evaluate_policy()
        return metrics, checkpoint

    def _replace_dead_actor(self, error: Exception) -> None:
        """After a step failed: when actor ranks died and nothing else did, every rank is replaced (a Megatron group
        cannot take one new rank) and the run rewinds to its newest complete checkpoint, or to the start before the
        first; the rollout engines and tool servers stay up, and the engines get the checkpoint's weights. The steps
        after the checkpoint are trained again (their trajectory records replaced), from the same prompts. Re-raises
        `error` otherwise, and a WorkerDiedError after trainer.max_actor_restarts replacements."""
        ray_error = is_ray_error(error)
        dead = dead_workers(self.parts.pool, self.parts.actor) if ray_error else []
        ranks = {name for name, _ in self.parts.actor.named_workers()}
        verdict = self.restart_policy.step_failed(ray_error, dead, ranks, self.progress.actor_restarts)
        if verdict.action is Action.RERAISE:
            raise error
        if verdict.action is Action.STOP:
            raise WorkerDiedError(self._died_message(dead, error) + verdict.limit_note, dead) from error
        started, failed_step, limit = time.perf_counter(), self.progress.step, self.restart_policy.actor_restarts
        self.progress.actor_restarts += 1
        self.parts.actor.shutdown(graceful=False)
        self.parts.actor = None  # a failed start leaves nothing for close() to stop
        self.parts.actor = self._start_actor()
        self.parts.weight_sync.replace_senders(self.parts.actor)
        self.rollouts.drop(self.parts.pool.group_timeout_s)
        point = self._rewind_to_newest_checkpoint()
        self.parts.logger.close()  # a new logger drops the TensorBoard points of the steps trained again
        self.parts.logger = self._new_logger(self.progress.step)
        self.check_parity()
        print(f"[rlsearch] {' and '.join(dead)} died during step {failed_step}: the actor ranks were replaced "
              f"({self.progress.actor_restarts} of trainer.max_actor_restarts={limit}) and the run continues after "
              f"step {self.progress.step} ({point.path if point else 'no checkpoint yet: from model.path'}), "
              f"{time.perf_counter() - started:.1f} s; the rollout engines stayed up", flush=True)

    def _rewind_to_newest_checkpoint(self) -> ResumePoint | None:
        """The run rewinds to the newest checkpoint this process saved or resumed from, the engines getting its
        weights as a new policy version; returns it (None: none yet)."""
        point = newest_own_checkpoint(self.config, self.progress.saved_checkpoints)
        version = self.progress.weight_version + 1  # the engines get other weights than the ones they sampled with
        if point is not None:
            self._resume(point, version)
        else:  # no checkpoint yet: the new ranks hold model.path's weights, and the run starts over
            self._rewind_progress(0, SamplerState())
            self.progress.weights_updated = False
            self._sync_engines(version)
        return point

    def _prints_step(self, step: int) -> bool:
        """Whether `step` gets a progress line (trainer.print_interval)."""
        total = self.config.trainer.total_steps
        interval = self.config.trainer.print_interval or -(-total // 10)
        return step in (1, total) or step % interval == 0

    def _died_message(self, dead: list[str], error: BaseException | None = None) -> str:
        checkpoint, _ = self.parts.checkpoints.newest_complete()
        return died_message(dead, self.progress.step, checkpoint, self.config.trainer.save_interval, error)

    def _revive_tool_servers(self) -> None:
        """A local tool server that died is started again before the next rollout is submitted (the calls that met
        it dead are error observations, counted in rollout/tool_errors)."""
        if self.parts.tool_servers is not None:
            for line in self.parts.tool_servers.revive():
                print(f"[rlsearch] {line}", flush=True)

    def train_step(self, rollout: PendingRollout) -> dict[str, float]:
        """One GRPO step on a submitted rollout; returns the step's metrics (also logged)."""
        timings, started, trained_version = {}, time.perf_counter(), self.progress.weight_version
        staleness = trained_version - rollout.weight_version  # as submitted, before step 1 may run it again
        self.progress.trained_sampler_state = rollout.sampler

        # 1. rollout: the step's trajectories (submitted up to rollout.async_steps steps ago)
        with timed(timings, "time/rollout_s"):
            trajectories: list[Trajectory] = self._rollout_trajectories(rollout)

        # 2. reward: every trajectory scored against its example (judge calls concurrently)
        with timed(timings, "time/reward_s"):
            reward_stats = self._score(trajectories, rollout.examples)

        # 3. algo: the groups to train (algo.filter_groups, data.batch_size), advantages (algo.advantage), token weights
        with timed(timings, "time/algo_s"):
            batch = select_groups(trajectories, self.config.algo, self.config.data.batch_size)
            samples = self._samples_to_train(rollout.step, trajectories, batch)

        # 4. actor: reference logprobs for the KL penalty (algo.kl_coef)
        with timed(timings, "time/ref_logprob_s"):
            self._add_reference_logprobs(samples)

        # 5. actor: the policy update, algo.ppo_epochs x algo.num_minibatches optimizer steps; the mismatch gate
        with timed(timings, "time/train_s"):
            update = policy_update(self.parts.actor, samples, self.config.algo) if samples else None
        self._check_mismatch(update)

        # 6. weights: the engines get the new weights (none when nothing changed) and must match the actor
        changed = update is not None and update.changed_weights
        self.progress.weights_updated |= changed
        sync_metrics = self._sync_weights(changed, timings)

        # 7. log
        return self._log_step(rollout, trajectories, trained_version, {
            **reward_stats, **batch.metrics(),
            "rollout/overlong_masked": float(overlong_masked(batch.trajectories, self.config.algo)),
            **(update.metrics if update else {"actor/updates": 0.0}), **sync_metrics,
            **self._run_metrics(rollout.step, update, staleness),
        }, actor_logprobs_of(batch.trajectories, samples), timings, started)

    def _rollout_trajectories(self, rollout: PendingRollout) -> list[Trajectory]:
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
                self._replace_dead_engines()
                print(f"[rlsearch] every rollout engine died during the rollout of step {rollout.step} ({error}); "
                      "they were restarted and synced, and the rollout runs again", flush=True)
            self._sync_engines()
            self.check_parity()
            rollout.weight_version = self.progress.weight_version
            rollout.trajectories = self.parts.pool.submit(rollout.items, rollout.step)

    def _score(self, trajectories: list[Trajectory], group_examples: list[QAExample]) -> dict[str, float]:
        """Rewards of the trajectories (and, with turn-level credit, of every model turn) against their examples
        (`group_examples[group_id]`); returns the reward stats."""
        examples = [group_examples[t.group_id] for t in trajectories]
        reward_stats = score_trajectories(trajectories, examples, self.config.reward)
        if self.config.algo.advantage != "outcome":  # turn-level credit: a reward for every model turn
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

    def _sync_weights(self, changed: bool, timings: dict[str, float]) -> dict[str, float]:
        """New weights into every engine, then the probe check. Without new weights (no update, or every update
        skipped for NaN/inf) the engines keep theirs, unless one was restarted: it starts from the weights on disk."""
        with timed(timings, "time/rollout_s"):
            if changed and self.rollouts and not self.config.rollout.update_weights_in_flight:
                # rollouts already submitted finish with the weights they were submitted under
                self.rollouts.wait()
        restarted = self._replace_dead_engines().action is Action.REPLACE
        if not (changed or restarted):
            return {"time/sync_s": 0.0, "weights/buckets": 0.0, "weights/engines": 0.0, "weights/sync_mib": 0.0}
        version = self.progress.weight_version + changed
        try:
            sync = self._sync_engines(version)
        except WeightSyncError:
            # an engine that died during the sync is replaced, and the sync (which forms its broadcast groups anew)
            # runs again once; the engines that lived stayed paused, so nothing sampled from half-loaded weights
            if self._replace_dead_engines().action is Action.RERAISE:
                raise
            sync = self._sync_engines(version)
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

    def _sync_engines(self, version: int | None = None) -> SyncStats:
        """The actor's weights into every engine as policy version `version` (default: the current one), the label
        of what they sample from them; progress.weight_version is that version once the sync finished."""
        version = self.progress.weight_version if version is None else version
        sync = self.parts.weight_sync.sync(self.parts.pool.engines, version)
        self.progress.weight_version = version
        return sync

    def _replace_dead_engines(self) -> Verdict:
        """Restart the rollout engines that died (REPLACE; RERAISE: none died). More than
        rollout.max_engine_restarts_per_step in one step stop the run (WorkerDiedError, naming the engines and the
        last checkpoint)."""
        dead = self.parts.pool.dead_engines()
        restarts = self.progress.restarts_by_step.get(self.progress.step, 0)
        verdict = self.restart_policy.engines_died(len(dead), restarts)
        if verdict.action is Action.STOP:
            names = [f"rollout engine {index}" for index in dead]
            raise WorkerDiedError(self._died_message(names) + verdict.limit_note, names)
        if verdict.action is Action.REPLACE:
            self.progress.restarts_by_step = {self.progress.step: restarts + len(dead)}
        for index in dead:
            self.parts.pool.restart(index)
            print(f"[rlsearch] restarted rollout engine {index}, which died; the current weights are synced into it "
                  "before the next rollout", flush=True)
        self.progress.engine_restarts += len(dead)
        return verdict

    def _log_step(
        self, rollout: PendingRollout, trajectories: list[Trajectory], trained_version: int,
        step_metrics: dict[str, float], actor_logprobs: dict[int, list[list[float]]], timings: dict[str, float],
        started: float,
    ) -> dict[str, float]:
        """The step's metrics (the trajectories', their token staleness, `step_metrics`, then the timings) logged,
        with the token staleness histogram and the trajectory records; returns them."""
        staleness_per_token = token_staleness(trajectories, trained_version)
        metrics = {
            **trajectory_metrics(trajectories),
            **staleness_metrics(staleness_per_token),
            **step_metrics,
            **timings,
            "time/step_s": time.perf_counter() - started,
        }
        self.parts.logger.log_metrics(self.progress.step, metrics)
        self.parts.logger.log_histogram(self.progress.step, "rollout/token_staleness", staleness_per_token)
        self.parts.logger.log_trajectories(self.progress.step, [
            self._trajectory_record(t, rollout, actor_logprobs.get(id(t)), trained_version) for t in trajectories
        ])
        return metrics

    def _run_metrics(self, step: int, update: PolicyUpdate | None, staleness: int) -> dict[str, float]:
        """Counters over the run and the rollout pool's view of the step."""
        skipped = update is not None and not update.changed_weights
        tools = self.parts.pool.tool_stats()
        return {
            **self.parts.pool.last_metrics(step),
            "actor/skipped_steps_total": float(self.skip_guard.total + skipped),
            "rollout/tool_failures_total": float(tools["failures"]),
            # calls the tools made (not answered by the tool store or an identical call in flight); paid: web APIs
            "rollout/tool_calls_out_total": float(tools.get("calls_out", 0)),
            "rollout/paid_calls_out_total": float(tools.get("paid_calls_out", 0)),
            # calls of the web adapters and the browse summariser that moved on from a failed endpoint to the next
            "rollout/tool_failovers_total": float(tools.get("failovers", 0)),
            "rollout/summariser_calls_total": float(tools.get("summariser_calls", 0)),  # pages the browse agent read
            "rollout/engine_restarts_total": float(self.progress.engine_restarts),
            "actor/restarts_total": float(self.progress.actor_restarts),
            "rollout/staleness": float(staleness),
            "time/engine_idle_s": self.parts.pool.idle_seconds(),
        }

    def _trajectory_record(
        self, trajectory: Trajectory, rollout: PendingRollout, actor_logprobs: list[list[float]] | None,
        trained_version: int,
    ) -> dict:
        """A trajectories/step_N.jsonl line: the trajectory, its question, how many weight versions behind the trained
        policy its oldest turn was sampled, and, where the update computed them, the actor's logprobs of each segment
        (`actor_logprobs` for the trajectory's own tokens, earlier segments' in theirs)."""
        record = trajectory.to_json()
        example = rollout.examples[trajectory.group_id]
        record.update(
            step=self.progress.step, question=example.question, golden_answers=list(example.golden_answers),
            staleness=trained_version - min(trajectory.weight_versions, default=rollout.weight_version),
        )
        if actor_logprobs is not None:
            *earlier, record["actor_logprobs"] = actor_logprobs
            for segment, logprobs in zip(record["earlier_segments"], earlier):
                segment["actor_logprobs"] = logprobs
        return record

    def _record_skip(self, metrics: dict[str, float]) -> None:
        """Count a step the actor skipped for a NaN/inf loss or grad norm; after trainer.max_consecutive_skips in a
        row, save the state of the last good step and stop with NonFiniteStepsError naming that checkpoint."""
        skipped = metrics.get("actor/skipped_nonfinite", 0.0) > 0
        if skipped:
            limit = self.config.trainer.max_consecutive_skips
            loss = metrics.get("actor/policy_loss", float("nan"))
            print(f"[rlsearch] warning: step {self.progress.step}: loss {loss:.4g}, "
                  f"NaN/inf in the loss or gradients: optimizer step skipped, weights unchanged "
                  f"({len(self.skip_guard.consecutive) + 1} in a row, stop at {limit or 'never'}; "
                  f"{self.skip_guard.total + 1} skipped in total)", flush=True)
        else:
            self.progress.good_sampler_state = self.progress.trained_sampler_state
        try:
            self.skip_guard.record(self.progress.step, skipped)
        except NonFiniteStepsError as error:
            if error.last_good_step and self.progress.weights_updated:
                error.checkpoint = self._checkpoint_of_step(error.last_good_step, self.progress.good_sampler_state)
            else:  # a fresh run that never updated: the model is model.path's and the optimizer has no state to save
                error.initial_model = self.config.model.path
            raise

    def _checkpoint_if_updated(self) -> Path | None:
        """A checkpoint of the current step, unless no step has updated the weights yet (algo.filter_groups dropped
        every group so far): the weights are still model.path's and the optimizer has no state to save."""
        if not self.progress.weights_updated:
            print(f"[rlsearch] no checkpoint after step {self.progress.step}: no step has updated the weights yet, "
                  f"they are model.path's ({self.config.model.path})", flush=True)
            return None
        return self.save_checkpoint()

    def _checkpoint_of_step(self, step: int, sampler: SamplerState) -> Path:
        """A checkpoint whose trainer state is `step`: the one this process saved (or resumed from) then, or a new one
        of the current actor state, which is that step's when every step since was skipped."""
        saved = self.progress.saved_checkpoints.get(step)
        if saved is not None and saved.is_dir():
            print(f"[rlsearch] the checkpoint of step {step} is {saved}", flush=True)
            return saved
        return self.save_checkpoint(step=step, sampler=sampler)

    def save_checkpoint(self, step: int | None = None, sampler: SamplerState | None = None) -> Path:
        """The actor state as the checkpoint of `step` (default: the current step) with the data position `sampler`
        (default: after the last trained batch)."""
        step = self.progress.step if step is None else step
        sampler = self.progress.trained_sampler_state if sampler is None else sampler
        path = save_run_checkpoint(self.config, self.parts.actor, self.parts.checkpoints, step, sampler)
        self.progress.saved_checkpoints[step] = path
        return path

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
        limit = self.config.weights.max_logprob_mismatch
        if limit is None:
            limit = default_mismatch_limit(self.config.model.dtype)
        parts = self.parts
        return check_engines_match_actor(parts.actor, parts.pool.engines, parts.probe_ids, limit, self.progress.step)
