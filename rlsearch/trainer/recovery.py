"""What the trainer does when a Ray actor of the run dies. The decisions are pure functions of what the trainer found
(is the error a Ray error, which workers are dead, how many restarts were spent) and live in one place,
`RestartPolicy`: the three retry sites (a rollout on which every engine died runs again on restarted engines, a sync
during which an engine died runs again once on its replacement, dead actor ranks are replaced and the run rewinds)
ask it and act on its `Verdict`. Also here: `WorkerDiedError`, the stop's message, and which workers are dead.

It may call Ray's exception types and `ray_setup.actor_states` (which workers are dead) and `runlog.ray_death` (how
Ray saw one die); replacing workers, rewinding and syncing (what a verdict says to do) are rollout_side.py's and
actor_side.py's."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from ..ray_setup import actor_states
from ..runlog import ray_death

if TYPE_CHECKING:
    from ..actor import ActorRanks
    from ..config import TrainConfig
    from ..rollout import EnginePool


class WorkerDiedError(RuntimeError):
    """A Ray actor of the run (a Megatron rank or the rollout worker) died: its process exited or was killed."""

    def __init__(self, message: str, dead: list[str]) -> None:
        super().__init__(message)
        self.dead = dead  # the names of the dead actors


class Action(Enum):
    REPLACE = "replace"  # replace the dead workers and run the failed part again
    STOP = "stop"  # stop the run: WorkerDiedError naming the dead
    RERAISE = "re-raise"  # no worker's death to recover from: the error goes on as it is


@dataclass(frozen=True)
class Verdict:
    action: Action
    limit_note: str = ""  # a STOP at a restart limit: what the died message ends with, naming the limit


@dataclass(frozen=True)
class RestartPolicy:
    """How many restarts a run may spend: engine restarts per step (rollout.max_engine_restarts_per_step) and actor
    replacements per run (trainer.max_actor_restarts)."""

    engine_restarts_per_step: int
    actor_restarts: int

    @classmethod
    def of(cls, config: TrainConfig) -> RestartPolicy:
        return cls(config.rollout.max_engine_restarts_per_step, config.trainer.max_actor_restarts)

    def rollout_lost_every_engine(self, failures: int) -> Verdict:
        """Every engine died during a rollout, its `failures`-th time: REPLACE them and run it again (its seeds are
        per question, sample and turn) while failures stay within the engine restarts of a step, else RERAISE the
        NoEngineLeftError (the trainer's stop names the dead engines)."""
        return Verdict(Action.REPLACE if failures <= self.engine_restarts_per_step else Action.RERAISE)

    def engines_died(self, dead: int, restarts_in_step: int) -> Verdict:
        """`dead` engines are found dead (before a sync, or after one failed), `restarts_in_step` engine restarts
        spent in this step so far: REPLACE them (a failed sync then runs again, once) within the limit, else STOP.
        RERAISE when none died: a failed sync had another cause."""
        if not dead:
            return Verdict(Action.RERAISE)
        limit = self.engine_restarts_per_step
        if restarts_in_step + dead <= limit:
            return Verdict(Action.REPLACE)
        return Verdict(Action.STOP, f" (after {restarts_in_step} engine restart(s) in this step: "
                                    f"rollout.max_engine_restarts_per_step={limit})")

    def step_failed(self, ray_error: bool, dead: list[str], actor_ranks: set[str], restarts: int) -> Verdict:
        """A step failed with a Ray error (`ray_error`) or another one; `dead` names the workers found dead,
        `actor_ranks` the actor ranks' names (and the critic ranks', replaced with them), `restarts` the
        replacements of this run so far. REPLACE the actor ranks when only ranks died and the run has replacements
        left; STOP when engines died too (they are not replaced here) or past trainer.max_actor_restarts; RERAISE
        when nothing died."""
        if not ray_error or not dead:
            return Verdict(Action.RERAISE)
        if not set(dead) <= actor_ranks:
            return Verdict(Action.STOP)
        limit = self.actor_restarts
        if restarts < limit:
            return Verdict(Action.REPLACE)
        return Verdict(Action.STOP, f" (after {restarts} actor restart(s) in this run: "
                                    f"trainer.max_actor_restarts={limit})" if limit else "")


def died_message(dead: list[str], step: int, checkpoint: Path | None, save_interval: int,
                 error: BaseException | None = None) -> str:
    """What died, Ray's account of how when `error` (the driver's call that met it dead) carries one (a signal,
    the OOM killer, Ray's memory monitor), and how to go on from `checkpoint`, the run's last complete one."""
    resume = (
        f"the last complete checkpoint is {checkpoint}: run the same command again (trainer.resume=auto) to "
        "continue from it" if checkpoint else
        f"no checkpoint was saved yet (trainer.save_interval={save_interval})"
    )
    how = ray_death(error) if error is not None else ""
    return (f"{' and '.join(dead)} died (its process exited) during step {step}"
            f"{f' (Ray: {how})' if how else ''}; the run stopped. {resume}")


def is_ray_error(error: BaseException | None) -> bool:
    """A Ray call failed: this error, or one it was raised from (a checkpoint that failed because a rank died)."""
    import ray

    while error is not None:
        if isinstance(error, ray.exceptions.RayError):
            return True
        error = error.__cause__
    return False


def dead_workers(pool: EnginePool | None, actor: ActorRanks | None, timeout_s: float = 10.0,
                 critic: ActorRanks | None = None) -> list[str]:
    """Names of the run's Ray actors (engines, actor ranks, critic ranks) whose process is gone: a call to a dead
    actor fails at once, a live one answers (or is busy, which is not dead)."""
    engines = pool.engines if pool is not None else []
    workers = [(f"rollout engine {index}", engine) for index, engine in enumerate(engines)] + [
        named for ranks in (actor, critic) if ranks is not None for named in ranks.named_workers()]
    states = actor_states([handle for _, handle in workers], timeout_s)
    return [name for (name, _), state in zip(workers, states) if state == "dead"]
