"""What `rlsearch train` prints when the run ends: the steps and seconds, the final and first-vs-last figures, the
calls out per 1,000 trajectories and where the run's outputs are."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RunSummary:
    output_dir: Path
    tensorboard_dir: Path
    trajectory_dir: Path | None
    checkpoint: Path | None
    steps: int
    seconds: float
    last_metrics: dict[str, float] = field(default_factory=dict)
    resumed_step: int = 0
    curves: Path | None = None  # PNG of the run's curves (rlsearch plot)
    history: list[dict[str, float]] = field(default_factory=list)  # this process's steps' metrics, in order

    def render(self) -> str:
        metrics = self.last_metrics
        trained = self.steps - self.resumed_step
        resumed = f" (resumed after step {self.resumed_step}, now at step {self.steps})" if self.resumed_step else ""
        lines = [
            f"rlsearch: trained {trained} steps in {self.seconds:.0f} s{resumed}",
            f"  final reward {metrics.get('reward/mean', 0):.3f}, EM {metrics.get('reward/em', 0):.3f}, "
            f"turns {metrics.get('rollout/turns_mean', 0):.2f}, "
            f"tool calls {metrics.get('rollout/tool_calls_mean', 0):.2f}",
        ]
        window = len(self.history) // 3
        if window:
            def mean(key: str, steps: list[dict[str, float]]) -> float:
                return statistics.fmean(step.get(key, 0.0) for step in steps)

            first, last = self.history[:window], self.history[-window:]
            lines.append(
                f"  over the run     : reward {mean('reward/mean', first):.3f} -> {mean('reward/mean', last):.3f}, "
                f"invalid calls {mean('rollout/invalid_calls_mean', first):.2f} -> "
                f"{mean('rollout/invalid_calls_mean', last):.2f} per trajectory (first {window} vs last {window} steps)"
            )
        trajectories = sum(step.get("rollout/trajectories", 0.0) for step in self.history)
        if trajectories:
            def per_1k(count: float) -> str:
                return f"{1000 * count / trajectories:.1f}"

            judged = sum(step.get("reward/judge_requests", 0.0) for step in self.history)
            tools, paid = metrics.get("rollout/tool_calls_out_total", 0), metrics.get("rollout/paid_calls_out_total", 0)
            lines.append(f"  calls out        : per 1,000 trajectories: tools {per_1k(tools)} (paid web APIs "
                         f"{per_1k(paid)}), judge {per_1k(judged)}")
        if self.trajectory_dir:
            lines.append(f"  trajectories     : {self.trajectory_dir}   (rlsearch inspect {self.output_dir})")
        if self.checkpoint:
            lines.append(f"  checkpoint       : {self.checkpoint}")
        if self.curves:
            lines.append(f"  curves           : {self.curves}")
        lines.append(f"  TensorBoard      : tensorboard --logdir {self.tensorboard_dir} --host 127.0.0.1")
        return "\n".join(lines)
