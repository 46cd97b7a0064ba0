"""The rollouts in flight: each step's batch drawn from the sampler and submitted to the engine pool up to
rollout.async_steps steps ahead of the step being trained, taken oldest first. It may call the sampler and the
pool's `submit`; running a rollout again when every engine died during it is rollout_side.py's."""

from __future__ import annotations

import math
from collections import deque
from concurrent import futures
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..rollout import PromptItem

if TYPE_CHECKING:
    from ..config import TrainConfig
    from ..data import QAExample
    from ..rollout import EnginePool
    from .progress import RunProgress
    from .sampler import EpochSampler, SamplerState


@dataclass
class PendingRollout:
    step: int  # the step that trains on it
    examples: list[QAExample]
    trajectories: futures.Future  # of list[Trajectory], from the engine pool
    items: list[PromptItem]  # what was submitted (run again when every engine died during it)
    weight_version: int  # updates the engine's weights had seen when it was submitted
    sampler: SamplerState  # the data position after its batch: what a checkpoint after its step records


class RolloutQueue:
    def __init__(self, sampler: EpochSampler[QAExample]) -> None:
        self.sampler = sampler
        self.pending: deque[PendingRollout] = deque()

    def __len__(self) -> int:
        return len(self.pending)

    def launch(self, config: TrainConfig, pool: EnginePool, progress: RunProgress) -> None:
        """Submit the rollouts of every step up to `rollout.async_steps` ahead of the current one. A rollout
        submitted under weight version v is trained on at most `async_steps` updates later; with
        `rollout.update_weights_in_flight` the syncs in between reach its later tokens, otherwise they wait for it."""
        last = min(progress.step + config.rollout.async_steps, config.trainer.total_steps)
        while progress.next_rollout_step <= last:
            examples = self.sampler.next_batch(math.ceil(config.data.batch_size * config.data.oversample))
            items = [
                PromptItem(example.id, example.question, group_id=index, sample_index=sample,
                           data_source=example.data_source, golden_answers=tuple(example.golden_answers))
                for index, example in enumerate(examples)
                for sample in range(config.rollout.group_size)
            ]
            self.pending.append(PendingRollout(
                step=progress.next_rollout_step, examples=examples,
                trajectories=pool.submit(items, progress.next_rollout_step), items=items,
                weight_version=progress.weight_version,
                sampler=replace(self.sampler.state),
            ))
            progress.next_rollout_step += 1

    def next(self) -> PendingRollout:
        """The oldest rollout: the current step's."""
        return self.pending.popleft()

    def wait(self, timeout_s: float | None = None) -> None:
        """Until every rollout in flight has finished (or `timeout_s` has passed)."""
        futures.wait([rollout.trajectories for rollout in self.pending], timeout=timeout_s)

    def drop(self, timeout_s: float) -> None:
        """Rollouts already submitted were sampled for steps that are trained again from other weights: they finish
        (or meet the pool's group timeout, `timeout_s`) and are dropped, their prompts drawn again."""
        self.wait(timeout_s)
        self.pending.clear()
