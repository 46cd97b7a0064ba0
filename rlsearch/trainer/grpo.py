"""The GRPO training loop (Ray driver): rollout -> reward -> advantages -> train -> weight sync -> log."""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Iterator
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

from .. import STARTED_AT
from ..actor import ActorRanks, ActorWorkerSpec, SamplingDistribution, TrainSample
from ..checkpoint import CheckpointError, CheckpointStore, load_run_checkpoint
from ..checkpoint.layout import MODEL_DIR
from ..config import (
    ConfigError,
    EvalConfig,
    TrainConfig,
    check_actor_devices,
    check_model_dir,
    check_model_layout,
    resolve_auto_keys,
    resolve_store_dirs,
    to_dict,
)
from ..data import QAExample, load_qa_dataset
from ..eval import evaluate
from ..memory import check_train_memory, waits_for_cluster
from ..ray_setup import actor_states, cluster_has_gpus, init_ray, ray_cpus, supervisor_ray_address
from ..reward import check_scorers, check_turn_scorers, score_trajectories, score_turns
from ..rollout import (
    EnginePool,
    NoEngineLeftError,
    PromptItem,
    Trajectory,
    start_engines,
    start_tool_servers,
    token_logit_bias,
)
from ..runlog import RunLogger, RunSummary, format_step_line, plot_run, ray_death
from ..weights import SyncStats, WeightSync, WeightSyncError, check_engines_match_actor, default_mismatch_limit
from .metrics import staleness_metrics, token_staleness, trajectory_metrics
from .mismatch_gate import check_rollout_mismatch
from .placement import check_retriever_reachable, describe_placement, plan_placement
from .progress import RunParts, RunProgress
from .sampler import EpochSampler, SamplerState
from .skip_guard import NonFiniteStepsError, SkipGuard
from .step_batch import StepBatch, actor_logprobs_of, overlong_masked, select_groups, train_samples
from .update import PolicyUpdate, policy_update

PROBE_CONTINUATION = "<search> who founded the town </search>"


@dataclass
class ResumePoint:
    path: Path
    layout: dict[str, int]  # the actor layout that saved it
    step: int
    sampler: SamplerState


@dataclass
class PendingRollout:
    step: int  # the step that trains on it
    examples: list[QAExample]
    trajectories: futures.Future  # of list[Trajectory], from the engine pool
    items: list[PromptItem]  # what was submitted (run again when every engine died during it)
    weight_version: int  # updates the engine's weights had seen when it was submitted
    sampler: SamplerState  # the data position after its batch: what a checkpoint after its step records


class WorkerDiedError(RuntimeError):
    """A Ray actor of the run (a Megatron rank or the rollout worker) died: its process exited or was killed."""

    def __init__(self, message: str, dead: list[str]) -> None:
        super().__init__(message)
        self.dead = dead  # the names of the dead actors


def _is_ray_error(error: BaseException | None) -> bool:
    """A Ray call failed: this error, or one it was raised from (a checkpoint that failed because a rank died)."""
    import ray

    while error is not None:
        if isinstance(error, ray.exceptions.RayError):
            return True
        error = error.__cause__
    return False


class GRPOTrainer:
    def __init__(self, config: TrainConfig) -> None:
        self.config = config = resolve_store_dirs(config, config.trainer.output_dir)  # tool and judge stores go there
        self.output_dir = Path(config.trainer.output_dir)
        self.parts = RunParts(CheckpointStore(self.output_dir, keep=config.trainer.keep_checkpoints))
        # a trainer.resume dir that is no complete run checkpoint stops the run here, before anything starts
        self.resume_point = self._checkpoint_to_resume()
        self.examples = self._load_examples()
        check_model_layout(config.model.path, config.actor, config.algo.routing_replay)
        # the memory plan: a run whose ranks or engines cannot fit stops here, before Ray, tool servers or actors start
        # (a cluster joined from a driver without a GPU: once Ray has joined it, below)
        if memory_line := check_train_memory(config):
            print(memory_line, flush=True)
        self.sampler = EpochSampler(self.examples, seed=config.trainer.seed, shuffle=config.data.shuffle)
        self.rollouts: deque[PendingRollout] = deque()
        # steps skipped for a NaN/inf loss or grad norm
        self.skip_guard = SkipGuard(config.trainer.max_consecutive_skips)
        self.progress = RunProgress()

    def _load_examples(self) -> list[QAExample]:
        config = self.config
        check_model_dir(config.model.path)
        examples = []
        for path in config.data.train_files:
            examples.extend(load_qa_dataset(path))
        check_scorers(examples, config.reward)  # every data source has a scorer, every judge its settings
        if config.algo.advantage != "outcome":  # turn-level credit: every row's turn scorer is known
            check_turn_scorers(examples, config.reward)
        return examples

    # ---- set-up ---------------------------------------------------------------------------------------

    def _start(self) -> None:
        config = self.config
        self.output_dir.mkdir(parents=True, exist_ok=True)
        seconds: dict[str, float] = {}  # of each start-up phase, for the line that reports them
        with _timed(seconds, "tool servers"):
            self.parts.tool_servers = start_tool_servers(config.tools)
        tools = self.parts.tool_servers.tools  # the config with the started servers' URLs filled in
        actor = config.actor
        world = actor.world_size
        rollout = config.rollout
        with _timed(seconds, "Ray"):
            init_ray(config.trainer.ray_address,
                     num_cpus=ray_cpus(world, rollout.num_engines, rollout.tensor_parallel_size))
        import ray

        # the cluster's GPUs, not this process's, decide: model.dtype and weights.transport `auto` become concrete here,
        # once, and everything below (and config.json) sees those values
        has_gpus = cluster_has_gpus()
        self.config = config = resolve_auto_keys(config, has_gpus)
        check_actor_devices(config.actor, has_gpus, config.model.dtype)  # before any engine or actor rank starts
        if waits_for_cluster(config) and (memory_line := check_train_memory(config, cluster_gpus=has_gpus)):
            print(memory_line, flush=True)
        (self.output_dir / "config.json").write_text(json.dumps(to_dict(config), indent=2))
        gpus = 1 if has_gpus else 0
        place = plan_placement(config.trainer.placement, world, gpus, config.trainer.ray_address,
                               rollout.num_engines, rollout.tensor_parallel_size)

        def start_pool() -> EnginePool:
            with _timed(seconds, "rollout engines"):
                # under the supervisor the engines outlive this driver, and a restarted one takes them over
                return start_engines(config.model, rollout, tools, config.trainer.seed,
                                     detached=bool(supervisor_ray_address()), **place.pool_options)

        # the engines and the actor ranks start side by side (each is mostly one process importing and loading); the
        # ranks, which start faster, after the tokenizer the actor's distribution needs has been read
        with ThreadPoolExecutor(1, thread_name_prefix="engine-start") as starter, _timed(seconds, "side by side"):
            starting_pool = starter.submit(start_pool)
            try:
                with _timed(seconds, "actor ranks"):
                    logit_bias = _token_logit_bias(config)
                    # kept: actor ranks that die are replaced by new ones (trainer.max_actor_restarts). Under the
                    # supervisor the ranks outlive this driver as the engines do, and a restarted one takes them
                    # over (not in a split placement, whose group the trainer reserves)
                    self._start_actor = partial(
                        ActorRanks, _actor_spec(config, logit_bias), num_gpus_per_rank=gpus,
                        detached=bool(supervisor_ray_address()) and not place.actor_options, **place.actor_options)
                    self.parts.actor = self._start_actor()
            finally:
                self.parts.pool = starting_pool.result()  # also when the actor failed: close() then stops the engines
        engine_bias = ray.get(self.parts.pool.engines[0].token_logit_bias.remote(), timeout=60)
        if engine_bias != logit_bias:
            raise RuntimeError(f"the engine's token logit bias {engine_bias} differs from the actor's {logit_bias}: "
                               f"the engine tokenises rollout.logit_bias differently from {config.model.path}'s "
                               "tokenizer")
        weights = config.weights
        self.parts.weight_sync = WeightSync(
            self.parts.actor, weights.bucket_mb, weights.transport, weights.timeout_s, rollout.tensor_parallel_size,
            delta=weights.delta, delta_full_every=weights.delta_full_every,
            # syncs land on rollouts in flight only with async_steps >= 1: else staging first would only cost memory
            stage_while_generating=weights.stage_while_generating and config.rollout.update_weights_in_flight
            and config.rollout.async_steps >= 1,
        )
        self.parts.probe_ids = ray.get(
            self.parts.pool.engines[0].probe_sequence.remote(self.examples[0].question, PROBE_CONTINUATION)
        )
        line, engine_ips = describe_placement(config.trainer.placement, self.parts.actor.workers,
                                              self.parts.pool.engines)
        print(line, flush=True)
        check_retriever_reachable(tools, engine_ips)
        if self.resume_point is not None:
            with _timed(seconds, "resume"):
                self._resume(self.resume_point)
            self.progress.resumed_step = self.resume_point.step
        elif self.parts.pool.adopted:  # engines taken over from a dead driver hold its later weights
            self._sync_engines()
        print(_startup_line(seconds), flush=True)
        self.parts.logger = self._new_logger(self.progress.resumed_step)

    def _new_logger(self, resumed_step: int) -> RunLogger:
        trainer = self.config.trainer
        return RunLogger(self.output_dir, trainer.log_trajectories, resumed_step=resumed_step, loggers=trainer.loggers,
                         config=to_dict(self.config), wandb_project=trainer.wandb_project,
                         wandb_run_name=trainer.wandb_run_name)

    def _checkpoint_to_resume(self) -> ResumePoint | None:
        resume = self.config.trainer.resume
        if resume == "none":
            return None
        if resume == "auto":
            path, skipped = self.parts.checkpoints.newest_complete()
            for warning in skipped:
                print(f"[rlsearch] warning: {warning}", flush=True)
            if path is None:
                return None
            manifest, state = load_run_checkpoint(path)
        else:
            path = Path(resume)
            try:
                manifest, state = load_run_checkpoint(path)
            except CheckpointError as error:
                raise ConfigError(f"'trainer.resume' (auto, none or a checkpoint dir): {error}") from error
        return self._resume_point(path, manifest, state)

    def _newest_own_checkpoint(self) -> ResumePoint | None:
        """The newest checkpoint this process saved or resumed from that is still whole (None: none), not one an
        earlier run left in output_dir (trainer.resume=none)."""
        for _, path in sorted(self.progress.saved_checkpoints.items(), reverse=True):
            try:
                return self._resume_point(path, *load_run_checkpoint(path))
            except CheckpointError:
                continue  # removed (trainer.keep_checkpoints) or damaged: an older one
        return None

    def _resume_point(self, path: Path, manifest: dict, state: dict) -> ResumePoint:
        if state["seed"] != self.config.trainer.seed:
            raise ConfigError(
                f"'trainer.seed' is {self.config.trainer.seed} but the checkpoint {path} was trained with seed "
                f"{state['seed']}; a resumed run keeps its seed so the data order and sampling continue. Drop the "
                f"override, or start a fresh run with trainer.resume=none"
            )
        saved = state["config"]["actor"].get("use_distributed_optimizer", False)
        if saved != self.config.actor.use_distributed_optimizer:
            raise ConfigError(
                f"'actor.use_distributed_optimizer' is {str(not saved).lower()} but the checkpoint {path} was written "
                f"with {str(saved).lower()}: the two keep Adam's states in different checkpoint layouts. Resume with "
                f"actor.use_distributed_optimizer={str(saved).lower()} (any actor.dp, tp or pp), or start a fresh run "
                "from its weights (rlsearch convert mcore-to-hf, then model.path)"
            )
        return ResumePoint(path, manifest["layout"], state["step"], SamplerState(**state["sampler"]))

    def _resume(self, point: ResumePoint, version: int | None = None) -> None:
        """Actor state from the checkpoint (resharded into this run's layout), then the engine gets those weights (as
        policy version `version`, default the current one); the step counter, data order and sampling seeds
        continue where the checkpoint left them."""
        # checkpoints from before actor.cp and actor.ep had no "cp" and "ep"
        same_layout = {"cp": 1, "ep": 1, **point.layout} == self.config.actor.layout
        self.parts.actor.load_checkpoint(str(point.path / MODEL_DIR), restore_rng=same_layout)
        self._rewind_progress(point.step, point.sampler)
        self.progress.weights_updated = True
        self.progress.saved_checkpoints[point.step] = point.path
        sync = self._sync_engines(version)
        saved = point.layout
        layouts = "" if same_layout else (
            f", resharded from tp{saved['tp']} pp{saved['pp']} cp{saved.get('cp', 1)} dp{saved['dp']} (per-rank RNG "
            "states start fresh)"
        )
        print(f"[rlsearch] resumed from {point.path} after step {self.progress.step}{layouts}; weights synced to the "
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
        started = time.perf_counter()
        died: list[str] = []
        try:
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
        except WorkerDiedError as error:
            died = error.dead
            raise
        except Exception as error:
            # a Ray call failed, or the rollout lost its last engine: name the actors that died
            died = self._dead_workers() if _is_ray_error(error) or isinstance(error, NoEngineLeftError) else []
            if died:
                raise WorkerDiedError(self._died_message(died, error), died) from error
            raise
        finally:
            self.close(graceful=not died)

    def _run_step(self) -> tuple[dict[str, float], Path | None]:
        """The next step, its progress line, then a checkpoint and an eval when they are due: (metrics, checkpoint)."""
        self.progress.step += 1
        self._revive_tool_servers()
        self._launch_rollouts()
        metrics = self.train_step(self.rollouts.popleft())
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
        if not _is_ray_error(error) or self.parts.actor is None:
            raise error
        dead = self._dead_workers()
        if not dead:
            raise error
        if not set(dead) <= {name for name, _ in self.parts.actor.named_workers()}:  # engines died too: stop
            raise WorkerDiedError(self._died_message(dead, error), dead) from error
        limit = self.config.trainer.max_actor_restarts
        if self.progress.actor_restarts >= limit:
            raise WorkerDiedError(self._died_message(dead, error) + (
                f" (after {self.progress.actor_restarts} actor restart(s) in this run: "
                f"trainer.max_actor_restarts={limit})" if limit else ""), dead) from error
        started, failed_step = time.perf_counter(), self.progress.step
        self.progress.actor_restarts += 1
        self.parts.actor.shutdown(graceful=False)
        self.parts.actor = None  # a failed start leaves nothing for close() to stop
        self.parts.actor = self._start_actor()
        self.parts.weight_sync.replace_senders(self.parts.actor)
        self._drop_pending_rollouts()
        point = self._newest_own_checkpoint()
        version = self.progress.weight_version + 1  # the engines get other weights than the ones they sampled with
        if point is not None:
            self._resume(point, version)
        else:  # no checkpoint yet: the new ranks hold model.path's weights, and the run starts over
            self._rewind_progress(0, SamplerState())
            self.progress.weights_updated = False
            self._sync_engines(version)
        self.parts.logger.close()  # a new logger drops the TensorBoard points of the steps trained again
        self.parts.logger = self._new_logger(self.progress.step)
        self.check_parity()
        print(f"[rlsearch] {' and '.join(dead)} died during step {failed_step}: the actor ranks were replaced "
              f"({self.progress.actor_restarts} of trainer.max_actor_restarts={limit}) and the run continues after "
              f"step {self.progress.step} ({point.path if point else 'no checkpoint yet: from model.path'}), "
              f"{time.perf_counter() - started:.1f} s; the rollout engines stayed up", flush=True)

    def _drop_pending_rollouts(self) -> None:
        """Rollouts already submitted were sampled for steps that are trained again from other weights: they finish
        (or meet the pool's group timeout) and are dropped, their prompts drawn again."""
        pending = [rollout.trajectories for rollout in self.rollouts]
        self.rollouts.clear()
        futures.wait(pending, timeout=self.parts.pool.group_timeout_s)

    def _prints_step(self, step: int) -> bool:
        """Whether `step` gets a progress line (trainer.print_interval)."""
        total = self.config.trainer.total_steps
        interval = self.config.trainer.print_interval or -(-total // 10)
        return step in (1, total) or step % interval == 0

    def _dead_workers(self, timeout_s: float = 10.0) -> list[str]:
        """Names of the run's Ray actors whose process is gone: a call to a dead actor fails at once, a live one
        answers (or is busy, which is not dead)."""
        engines = self.parts.pool.engines if self.parts.pool is not None else []
        workers = [(f"rollout engine {index}", engine) for index, engine in enumerate(engines)] + (
            self.parts.actor.named_workers() if self.parts.actor is not None else []
        )
        states = actor_states([handle for _, handle in workers], timeout_s)
        return [name for (name, _), state in zip(workers, states) if state == "dead"]

    def _died_message(self, dead: list[str], error: BaseException | None = None) -> str:
        """What died, Ray's account of how when `error` (the driver's call that met it dead) carries one (a signal,
        the OOM killer, Ray's memory monitor), and how to go on."""
        checkpoint, _ = self.parts.checkpoints.newest_complete()
        resume = (
            f"the last complete checkpoint is {checkpoint}: run the same command again (trainer.resume=auto) to "
            "continue from it" if checkpoint else
            f"no checkpoint was saved yet (trainer.save_interval={self.config.trainer.save_interval})"
        )
        how = ray_death(error) if error is not None else ""
        return (f"{' and '.join(dead)} died (its process exited) during step {self.progress.step}"
                f"{f' (Ray: {how})' if how else ''}; the run stopped. {resume}")

    def _revive_tool_servers(self) -> None:
        """A local tool server that died is started again before the next rollout is submitted (the calls that met
        it dead are error observations, counted in rollout/tool_errors)."""
        if self.parts.tool_servers is not None:
            for line in self.parts.tool_servers.revive():
                print(f"[rlsearch] {line}", flush=True)

    def _launch_rollouts(self) -> None:
        """Submit the rollouts of every step up to `rollout.async_steps` ahead of the current one. A rollout
        submitted under weight version v is trained on at most `async_steps` updates later; with
        `rollout.update_weights_in_flight` the syncs in between reach its later tokens, otherwise they wait for it."""
        config = self.config
        last = min(self.progress.step + config.rollout.async_steps, config.trainer.total_steps)
        while self.progress.next_rollout_step <= last:
            examples = self.sampler.next_batch(math.ceil(config.data.batch_size * config.data.oversample))
            items = [
                PromptItem(example.id, example.question, group_id=index, sample_index=sample,
                           data_source=example.data_source, golden_answers=tuple(example.golden_answers))
                for index, example in enumerate(examples)
                for sample in range(config.rollout.group_size)
            ]
            self.rollouts.append(PendingRollout(
                step=self.progress.next_rollout_step, examples=examples,
                trajectories=self.parts.pool.submit(items, self.progress.next_rollout_step), items=items,
                weight_version=self.progress.weight_version,
                sampler=replace(self.sampler.state),
            ))
            self.progress.next_rollout_step += 1

    def train_step(self, rollout: PendingRollout) -> dict[str, float]:
        """One GRPO step on a submitted rollout; returns the step's metrics (also logged)."""
        config, timings = self.config, {}
        started = time.perf_counter()
        trained_version = self.progress.weight_version
        staleness = trained_version - rollout.weight_version
        self.progress.trained_sampler_state = rollout.sampler

        # 1. rollout: the step's trajectories (submitted up to rollout.async_steps steps ago)
        with _timed(timings, "time/rollout_s"):
            trajectories: list[Trajectory] = self._rollout_trajectories(rollout)

        with _timed(timings, "time/reward_s"):
            # 2. reward: every trajectory scored against its example (judge calls concurrently)
            examples = [rollout.examples[t.group_id] for t in trajectories]
            reward_stats = score_trajectories(trajectories, examples, config.reward)
            if config.algo.advantage != "outcome":  # turn-level credit: a reward for every model turn
                reward_stats.update(score_turns(trajectories, examples, config.reward))
            # 3. algo: the groups to train (algo.filter_groups, data.batch_size), advantages (per trajectory or per
            # turn) and token weights
            batch = select_groups(trajectories, config.algo, config.data.batch_size)
            samples = self._samples_to_train(rollout.step, trajectories, batch)

        # 4. actor: reference logprobs for the KL penalty (algo.kl_coef)
        with _timed(timings, "time/ref_logprob_s"):
            if samples and config.algo.kl_coef > 0:
                for sample, logprobs in zip(samples, self.parts.actor.compute_logprobs(samples, reference=True)):
                    sample.ref_logprobs = logprobs

        # 5. actor: the policy update, algo.ppo_epochs x algo.num_minibatches optimizer steps
        with _timed(timings, "time/train_s"):
            update = policy_update(self.parts.actor, samples, config.algo) if samples else None
        # the mismatch gate (algo.mismatch_threshold): a warning line, or the run stops before the sync
        if update is not None and (line := check_rollout_mismatch(
                self.progress.step, update.metrics, config.algo.mismatch_threshold, config.algo.mismatch_action)):
            print(f"[rlsearch] {line}", flush=True)

        # 6. weights: the engines get the new weights (none when nothing changed) and must match the actor
        changed = update is not None and update.changed_weights
        self.progress.weights_updated |= changed
        sync_metrics = self._sync_weights(changed, timings)

        # 7. log
        staleness_per_token = token_staleness(trajectories, trained_version)
        metrics = {
            **trajectory_metrics(trajectories),
            **staleness_metrics(staleness_per_token),
            **reward_stats,
            **batch.metrics(),
            "rollout/overlong_masked": float(overlong_masked(batch.trajectories, config.algo)),
            **(update.metrics if update else {"actor/updates": 0.0}),
            **sync_metrics,
            **self._run_metrics(rollout.step, update, staleness),
            **timings,
            "time/step_s": time.perf_counter() - started,
        }
        self.parts.logger.log_metrics(self.progress.step, metrics)
        self.parts.logger.log_histogram(self.progress.step, "rollout/token_staleness", staleness_per_token)
        actor_logprobs = actor_logprobs_of(batch.trajectories, samples)
        self.parts.logger.log_trajectories(self.progress.step, [
            self._trajectory_record(t, rollout, actor_logprobs.get(id(t)), trained_version) for t in trajectories
        ])
        return metrics

    def _rollout_trajectories(self, rollout: PendingRollout) -> list[Trajectory]:
        """The rollout's trajectories. When every engine died during it, the engines are restarted, given the current
        weights (a restarted engine starts from model.path's) and the rollout runs again on them (its seeds are per
        question, sample and turn), at most rollout.max_engine_restarts_per_step times. (With rollout.async_steps
        >= 1 the sync before this step may have restarted them already.)"""
        attempts = 0
        while True:
            try:
                return rollout.trajectories.result()
            except NoEngineLeftError as error:
                attempts += 1
                if attempts > self.config.rollout.max_engine_restarts_per_step:
                    raise
                self._replace_dead_engines()
                print(f"[rlsearch] every rollout engine died during the rollout of step {rollout.step} ({error}); "
                      "they were restarted and synced, and the rollout runs again", flush=True)
            self._sync_engines()
            self.check_parity()
            rollout.weight_version = self.progress.weight_version
            rollout.trajectories = self.parts.pool.submit(rollout.items, rollout.step)

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

    def _sync_weights(self, changed: bool, timings: dict[str, float]) -> dict[str, float]:
        """New weights into every engine, then the probe check. Without new weights (no update, or every update
        skipped for NaN/inf) the engines keep theirs, unless one was restarted: it starts from the weights on disk."""
        with _timed(timings, "time/rollout_s"):
            if changed and self.rollouts and not self.config.rollout.update_weights_in_flight:
                # rollouts already submitted finish with the weights they were submitted under
                futures.wait([pending.trajectories for pending in self.rollouts])
        restarted = self._replace_dead_engines()
        if not (changed or restarted):
            return {"time/sync_s": 0.0, "weights/buckets": 0.0, "weights/engines": 0.0, "weights/sync_mib": 0.0}
        version = self.progress.weight_version + changed
        try:
            sync = self._sync_engines(version)
        except WeightSyncError:
            # an engine that died during the sync is replaced, and the sync (which forms its broadcast groups anew)
            # runs again once; the engines that lived stayed paused, so nothing sampled from half-loaded weights
            if not self._replace_dead_engines():
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

    def _checkpoint_if_updated(self) -> Path | None:
        """A checkpoint of the current step, unless no step has updated the weights yet (algo.filter_groups dropped
        every group so far): the weights are still model.path's and the optimizer has no state to save."""
        if not self.progress.weights_updated:
            print(f"[rlsearch] no checkpoint after step {self.progress.step}: no step has updated the weights yet, "
                  f"they are model.path's ({self.config.model.path})", flush=True)
            return None
        return self.save_checkpoint()

    def _replace_dead_engines(self) -> int:
        """Restart the rollout engines that died; returns how many. More than rollout.max_engine_restarts_per_step
        in one step stop the run (WorkerDiedError, naming the engines and the last checkpoint)."""
        dead = self.parts.pool.dead_engines()
        if dead:
            restarts = self.progress.restarts_by_step.get(self.progress.step, 0) + len(dead)
            limit = self.config.rollout.max_engine_restarts_per_step
            if restarts > limit:
                names = [f"rollout engine {index}" for index in dead]
                raise WorkerDiedError(self._died_message(names) + (
                    f" (after {restarts - len(dead)} engine restart(s) in this step: "
                    f"rollout.max_engine_restarts_per_step={limit})"), names)
            self.progress.restarts_by_step = {self.progress.step: restarts}
        for index in dead:
            self.parts.pool.restart(index)
            print(f"[rlsearch] restarted rollout engine {index}, which died; the current weights are synced into it "
                  "before the next rollout", flush=True)
        self.progress.engine_restarts += len(dead)
        return len(dead)

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

    def _checkpoint_of_step(self, step: int, sampler: SamplerState) -> Path:
        """A checkpoint whose trainer state is `step`: the one this process saved (or resumed from) then, or a new one
        of the current actor state, which is that step's when every step since was skipped."""
        saved = self.progress.saved_checkpoints.get(step)
        if saved is not None and saved.is_dir():
            print(f"[rlsearch] the checkpoint of step {step} is {saved}", flush=True)
            return saved
        return self.save_checkpoint(step=step, sampler=sampler)

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

    def save_checkpoint(self, step: int | None = None, sampler: SamplerState | None = None) -> Path:
        """The actor state as the checkpoint of `step` (default: the current step) with the data position `sampler`
        (default: after the last trained batch)."""
        config = self.config
        step = self.progress.step if step is None else step
        state = {
            # where the data stood after the last trained batch (batches already drawn for later steps are drawn
            # again after a resume)
            "sampler": asdict(self.progress.trained_sampler_state if sampler is None else sampler),
            # rollout sampling seeds are a function of (seed, step, prompt, sample, turn): this and the step are the
            # whole rollout-side state
            "seed": config.trainer.seed,
            "config": to_dict(config),
        }
        architecture = json.loads((Path(config.model.path) / "config.json").read_text()).get("model_type")
        info = {
            "layout": self.config.actor.layout, "architecture": architecture, "dtype": config.model.dtype,
            "transformer_impl": self.parts.actor.infos[0].transformer_impl,
            "contents": ["model", "optimizer", "scheduler", "rng"],
        }
        save = partial(self.parts.actor.save_checkpoint, timeout_s=config.trainer.checkpoint_timeout_s)
        path = self.parts.checkpoints.save(step, save, state, config.model.path, info)
        self.progress.saved_checkpoints[step] = path
        print(f"[rlsearch] checkpoint saved: {path}", flush=True)
        return path


def _token_logit_bias(config: TrainConfig) -> dict[int, float]:
    """rollout.logit_bias per token, as the engines apply it (read with the model's tokenizer: ~3.5 s here with its
    imports, none without a bias)."""
    if not config.rollout.logit_bias:
        return {}
    from transformers import AutoTokenizer

    return token_logit_bias(AutoTokenizer.from_pretrained(config.model.path), config.rollout.logit_bias)


def _actor_spec(config: TrainConfig, logit_bias: dict[int, float]) -> ActorWorkerSpec:
    """The actor ranks' spec: they score tokens under the distribution the engines sample them from."""
    return ActorWorkerSpec(
        model_path=config.model.path, dtype=config.model.dtype, actor=config.actor, algo=config.algo,
        sampling=SamplingDistribution(config.rollout.temperature, logit_bias), seed=config.trainer.seed,
        # the LR schedule counts optimizer updates
        total_steps=config.trainer.total_steps * config.algo.num_minibatches * config.algo.ppo_epochs,
    )


def _startup_line(seconds: dict[str, float]) -> str:
    """How long the driver took to start, from rlsearch's start in its process, and where the time went."""
    total = time.time() - STARTED_AT
    phases = [f"{name} {seconds[name]:.1f}" for name in ("tool servers", "Ray") if name in seconds]
    phases.append(f"rollout engines {seconds.get('rollout engines', 0.0):.1f} and actor ranks "
                  f"{seconds.get('actor ranks', 0.0):.1f} side by side ({seconds.get('side by side', 0.0):.1f})")
    if "resume" in seconds:
        phases.append(f"resume {seconds['resume']:.1f}")
    rest = total - sum(seconds.get(name, 0.0) for name in ("tool servers", "Ray", "side by side", "resume"))
    return f"[rlsearch] started in {total:.1f} s: {', '.join(phases)}, the rest (imports, data, checks) {rest:.1f}"


@contextmanager
def _timed(timings: dict[str, float], key: str) -> Iterator[None]:
    """Adds the seconds the block takes to timings[key]."""
    started = time.perf_counter()
    try:
        yield
    finally:
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - started
