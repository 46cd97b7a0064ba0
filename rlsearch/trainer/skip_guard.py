"""Bookkeeping of optimizer steps skipped for a NaN/inf loss or grad norm: the run goes on through a few, and stops
after `trainer.max_consecutive_skips` in a row (a persistent fault, not a one-off bad batch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


class NonFiniteStepsError(RuntimeError):
    """Too many consecutive steps had a NaN/inf loss or grad norm. The trainer sets `checkpoint` once it has saved the
    state of `last_good_step`, or `initial_model` when no step of the run updated the weights (an optimizer that
    never stepped has no state to checkpoint); the message names it."""

    def __init__(self, steps: list[int], last_good_step: int, limit: int) -> None:
        super().__init__(steps, last_good_step, limit)
        self.steps = list(steps)
        self.last_good_step = last_good_step
        self.limit = limit
        self.checkpoint: Path | None = None
        self.initial_model: str | None = None

    def __str__(self) -> str:
        steps = ", ".join(str(step) for step in self.steps)
        since = f"step {self.last_good_step}" if self.last_good_step else "the run started (step 0)"
        message = (
            f"the loss or gradient norm was NaN/inf in {len(self.steps)} consecutive steps ({steps}), "
            f"trainer.max_consecutive_skips={self.limit}; each of these optimizer steps was skipped, so the weights "
            f"were not updated since {since}"
        )
        if self.checkpoint is not None:
            message += (
                f". Checkpoint of step {self.last_good_step} (weights, optimizer and data position from before step "
                f"{self.steps[0]}): {self.checkpoint}; continue from it with trainer.resume={self.checkpoint}"
            )
        elif self.initial_model is not None:
            message += (
                f". No step of this run updated the weights, so no checkpoint was saved: they are those of "
                f"model.path={self.initial_model}; start the run again once the cause is fixed"
            )
        return message + (
            ". Look for NaN/inf in the rewards and rollout logprobs of these steps' trajectories, or lower actor.lr"
        )


@dataclass
class SkipGuard:
    """`record(step, skipped)` after every step: counts skipped steps in total and in a row, and raises
    `NonFiniteStepsError` at the `max_consecutive`-th skip in a row (0: never)."""

    max_consecutive: int
    last_good_step: int = 0  # the last step whose update was applied (the resumed step, or 0, before any)
    total: int = 0  # skipped steps of this process
    consecutive: list[int] = field(default_factory=list)  # the skipped steps since the last good one

    def record(self, step: int, skipped: bool) -> None:
        if not skipped:
            self.last_good_step = step
            self.consecutive.clear()
            return
        self.total += 1
        self.consecutive.append(step)
        if self.max_consecutive and len(self.consecutive) >= self.max_consecutive:
            raise NonFiniteStepsError(self.consecutive, self.last_good_step, self.max_consecutive)
