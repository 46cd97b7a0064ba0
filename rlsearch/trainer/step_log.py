"""What a GRPO step logs: its metrics (the trajectories', their token staleness, the step's own, the run's counters and
the timings), the token staleness histogram and the trajectory records; which steps print a progress line; the run's
logger. It may call the logger, the engine pool's counters and trainer/metrics.py; when to log is the loop's."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import TrainConfig, to_dict
from ..runlog import RunLogger
from .metrics import staleness_metrics, token_staleness, trajectory_metrics

if TYPE_CHECKING:
    from ..rollout import EnginePool, Trajectory
    from .progress import RunProgress
    from .rollouts import PendingRollout
    from .update import PolicyUpdate


def new_logger(config: TrainConfig, output_dir: Path, resumed_step: int) -> RunLogger:
    """The run's logger; `resumed_step` > 0 keeps the TensorBoard points up to that step and replaces the later ones."""
    trainer = config.trainer
    return RunLogger(output_dir, trainer.log_trajectories, resumed_step=resumed_step, loggers=trainer.loggers,
                     config=to_dict(config), wandb_project=trainer.wandb_project,
                     wandb_run_name=trainer.wandb_run_name)


def prints_step(step: int, total_steps: int, print_interval: int) -> bool:
    """Whether `step` gets a progress line: the first, the last, and every trainer.print_interval-th (0: a tenth of
    the run)."""
    interval = print_interval or -(-total_steps // 10)
    return step in (1, total_steps) or step % interval == 0


def log_step(
    logger: RunLogger, step: int, rollout: PendingRollout, trajectories: list[Trajectory], trained_version: int,
    step_metrics: dict[str, float], token_series: dict[int, dict[str, list]], timings: dict[str, float],
    started: float,
) -> dict[str, float]:
    """The step's metrics (the trajectories', their token staleness, `step_metrics`, then the timings and the step's
    seconds since `started`) logged, with the token staleness histogram and the trajectory records; returns them."""
    staleness_per_token = token_staleness(trajectories, trained_version)
    metrics = {
        **trajectory_metrics(trajectories),
        **staleness_metrics(staleness_per_token),
        **step_metrics,
        **timings,
        "time/step_s": time.perf_counter() - started,
    }
    logger.log_metrics(step, metrics)
    logger.log_histogram(step, "rollout/token_staleness", staleness_per_token)
    logger.log_trajectories(step, [
        trajectory_record(t, rollout, step, token_series.get(id(t), {}), trained_version) for t in trajectories
    ])
    return metrics


def run_metrics(pool: EnginePool, progress: RunProgress, step: int, update: PolicyUpdate | None,
                staleness: int) -> dict[str, float]:
    """Counters over the run and the rollout pool's view of `step` (the rollout's, trained `staleness` versions
    after it was submitted)."""
    skipped = update is not None and not update.changed_weights
    tools = pool.tool_stats()
    return {
        **pool.last_metrics(step),
        "actor/skipped_steps_total": float(progress.skip_guard.total + skipped),
        "rollout/tool_failures_total": float(tools["failures"]),
        # calls the tools made (not answered by the tool store or an identical call in flight); paid: web APIs
        "rollout/tool_calls_out_total": float(tools.get("calls_out", 0)),
        "rollout/paid_calls_out_total": float(tools.get("paid_calls_out", 0)),
        # calls of the web adapters and the browse summariser that moved on from a failed endpoint to the next
        "rollout/tool_failovers_total": float(tools.get("failovers", 0)),
        "rollout/summariser_calls_total": float(tools.get("summariser_calls", 0)),  # pages the browse agent read
        "rollout/engine_restarts_total": float(progress.engine_restarts),
        "actor/restarts_total": float(progress.actor_restarts),
        "rollout/staleness": float(staleness),
        "time/engine_idle_s": pool.idle_seconds(),
    }


def trajectory_record(
    trajectory: Trajectory, rollout: PendingRollout, step: int, token_series: dict[str, list[list[float]]],
    trained_version: int,
) -> dict:
    """A trajectories/step_N.jsonl line: the trajectory, its question, how many weight versions behind the trained
    policy its oldest turn was sampled, and what the step computed per token of each segment (`token_series`:
    "actor_logprobs" where the update computed them, "critic_values" with a critic): the last segment's under the
    trajectory's own tokens, earlier segments' in theirs."""
    record = trajectory.to_json()
    example = rollout.examples[trajectory.group_id]
    record.update(
        step=step, question=example.question, golden_answers=list(example.golden_answers),
        staleness=trained_version - min(trajectory.weight_versions, default=rollout.weight_version),
    )
    for name, per_segment in token_series.items():
        *earlier, record[name] = per_segment
        for segment, values in zip(record["earlier_segments"], earlier):
            segment[name] = values
    return record
