"""TensorBoard scalars + per-step trajectory JSONL under one run directory."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

_STEP_LINE_KEYS = (
    ("reward", "reward/mean", "{:.3f}"),
    ("EM", "reward/em", "{:.3f}"),
    ("turns", "rollout/turns_mean", "{:.2f}"),
    ("calls", "rollout/tool_calls_mean", "{:.2f}"),
    ("invalid", "rollout/invalid_calls_mean", "{:.2f}"),
    ("len", "rollout/response_len_mean", "{:.0f}"),
    ("loss", "actor/policy_loss", "{:+.4f}"),
    ("mismatch", "weights/logprob_mismatch_max", "{:.1e}"),
    ("time", "time/step_s", "{:.1f}s"),
)


def format_step_line(step: int, total_steps: int, metrics: Mapping[str, float]) -> str:
    parts = [f"step {step}/{total_steps}"]
    for label, key, fmt in _STEP_LINE_KEYS:
        if key in metrics:
            parts.append(f"{label} {fmt.format(metrics[key])}")
    return " | ".join(parts)


class RunLogger:
    def __init__(self, output_dir: str | Path, log_trajectories: bool = True, resumed_step: int = 0) -> None:
        """`resumed_step`: the step a resumed run continues after. TensorBoard then drops what an earlier run logged
        for later steps (a step that was logged but not checkpointed is trained again), so each step shows once."""
        from torch.utils.tensorboard import SummaryWriter

        self.output_dir = Path(output_dir)
        self.tensorboard_dir = self.output_dir / "tensorboard"
        self.trajectory_dir = self.output_dir / "trajectories"
        self.write_trajectories = log_trajectories
        self.tensorboard_dir.mkdir(parents=True, exist_ok=True)
        if self.write_trajectories:
            self.trajectory_dir.mkdir(parents=True, exist_ok=True)
        purge_step = resumed_step + 1 if resumed_step else None
        self.writer = SummaryWriter(log_dir=str(self.tensorboard_dir), purge_step=purge_step)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def log_histogram(self, step: int, key: str, values: Sequence[float]) -> None:
        """A TensorBoard histogram (nothing for no values)."""
        if values:
            self.writer.add_histogram(key, np.asarray(values, dtype=np.float64), global_step=step)

    def log_trajectories(self, step: int, records: Iterable[dict]) -> Path | None:
        if not self.write_trajectories:
            return None
        path = self.trajectory_dir / f"step_{step:06d}.jsonl"
        with path.open("w") as handle:
            for record in records:
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        return path

    def close(self) -> None:
        self.writer.close()
