"""A training run's two kinds of state: the parts it started (`RunParts`) and where it stands (`RunProgress`: the
step, the data position with the sampler that holds it, the evolving rubrics, the skip guard and the counters;
`rewind` sets it back)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint import CheckpointStore
from ..reward.evolving import RubricBuffer
from .sampler import EpochSampler, SamplerState
from .skip_guard import SkipGuard

if TYPE_CHECKING:
    from ..actor import ActorRanks, CriticRanks
    from ..rollout import EnginePool
    from ..runlog import RunLogger
    from ..tools import ToolServers
    from ..weights import AdapterSync, WeightSync


@dataclass
class RunProgress:
    """Where the run stands: the step and the data position a checkpoint records, the sampler that draws from it,
    the skip guard (steps skipped for a NaN/inf loss or grad norm), and the counters beside them."""

    step: int = 0  # the step being trained (the last one trained, between steps)
    resumed_step: int = 0  # the step a resumed run continued after (0: a fresh run)
    # whether the actor's weights and optimizer have been updated (in this run, or in the one it resumes): an
    # optimizer that never stepped has no state to checkpoint
    weights_updated: bool = False
    weight_version: int = 0  # optimizer updates synced into the engines (this process's)
    next_rollout_step: int = 1  # the step whose rollout is submitted next (rollout.async_steps ahead)
    # the data position after the last trained batch (batches drawn for later steps are drawn again after a resume),
    # and after the last step that updated the weights (what a stop for NaN/inf steps records)
    trained_sampler_state: SamplerState = field(default_factory=SamplerState)
    good_sampler_state: SamplerState = field(default_factory=SamplerState)
    saved_checkpoints: dict[int, Path] = field(default_factory=dict)  # step -> a checkpoint of it (saved or resumed)
    engine_restarts: int = 0  # rollout engines that died and were replaced
    restarts_by_step: dict[int, int] = field(default_factory=dict)  # engine restarts of the current step
    actor_restarts: int = 0  # times the actor ranks were replaced after one died (trainer.max_actor_restarts)
    sampler: EpochSampler | None = None  # the prompt order (None: a run state without data, in unit tests)
    skip_guard: SkipGuard = field(default_factory=lambda: SkipGuard(0))
    # each question's evolving rubrics (reward.rubric.evolve; None: off), saved with every checkpoint
    rubrics: RubricBuffer | None = None

    def rewind(self, step: int, sampler: SamplerState, rubrics: dict | None = None) -> None:
        """The run stands after `step` with the data position `sampler` and the evolving rubrics `rubrics` (a
        buffer's `to_state`; None: none yet): the next rollout is `step + 1`'s, and the skip guard counts afresh
        from `step`, its last good one."""
        self.step = step
        if self.rubrics is not None:
            self.rubrics = RubricBuffer.from_state(rubrics or {"questions": {}}, self.rubrics.max_active,
                                                   self.rubrics.persistent)
        self.next_rollout_step = step + 1
        if self.sampler is not None:
            self.sampler.restore(sampler)
        self.trained_sampler_state = self.good_sampler_state = sampler
        self.skip_guard = SkipGuard(self.skip_guard.max_consecutive, last_good_step=step)


@dataclass
class RunParts:
    """What the run started, each part once (`startup.start_run` fills them in as they start), stopped together."""

    checkpoints: CheckpointStore
    tool_servers: ToolServers | None = None
    pool: EnginePool | None = None
    actor: ActorRanks | None = None
    critic: CriticRanks | None = None  # algo.advantage=gae: on the actor ranks' devices
    weight_sync: WeightSync | AdapterSync | None = None
    probe_ids: list[int] = field(default_factory=list)  # the probe check's sequence (weights.check_engines_match_actor)
    logger: RunLogger | None = None

    def stop(self, graceful: bool = True) -> None:
        """Stop what started; `graceful` False when a Ray actor of the run died (no call waits for the dead)."""
        if self.critic is not None:  # first: its ranks are in the actor's placement group
            self.critic.shutdown(graceful)
        if self.actor is not None:
            self.actor.shutdown(graceful)
        if self.pool is not None:
            self.pool.close()
        if self.tool_servers is not None:
            self.tool_servers.stop()
        if self.logger is not None:
            self.logger.close()
