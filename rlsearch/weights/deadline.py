"""Every wait of a sync against one deadline (`weights.timeout_s`): a sync that cannot finish raises, naming the
engines that did not answer or died, instead of hanging."""

from __future__ import annotations

import time
from collections.abc import Sequence


class WeightSyncError(RuntimeError):
    """A sync did not finish: the engines stay paused (nothing samples from half-loaded weights)."""


class Deadline:
    def __init__(self, timeout_s: float, engines: Sequence) -> None:
        self.timeout_s = timeout_s
        self.engines = list(engines)
        self._end = time.perf_counter() + timeout_s

    def remaining(self) -> float:
        return max(0.0, self._end - time.perf_counter())

    def wait(self, refs: Sequence, what: str, owners: Sequence | None = None) -> None:
        """Wait until all of `refs` are ready; `owners[i]` is the engine behind `refs[i]` when each is one engine's."""
        import ray

        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.remaining())
        if len(ready) < len(refs):
            late = [self._engine_name(owner) for ref, owner in zip(refs, owners or []) if ref not in ready]
            raise WeightSyncError(
                f"weight sync: {what} did not finish within weights.timeout_s={self.timeout_s:g} s"
                f"{' (waiting on ' + ', '.join(late) + ')' if late else ''}; {self._engine_health()}"
            )

    def get(self, refs: Sequence, what: str, owners: Sequence | None = None) -> list:
        import ray

        self.wait(refs, what, owners)
        try:
            return ray.get(list(refs))
        except ray.exceptions.RayError as error:
            raise WeightSyncError(f"weight sync: {what} failed ({type(error).__name__}); {self._engine_health()}") \
                from error

    def _engine_name(self, engine) -> str:
        return f"engine {self.engines.index(engine)}" if engine in self.engines else "the actor"

    def _engine_health(self) -> str:
        """Which engines are dead or not answering (a live engine answers a ping within seconds)."""
        from ..ray_setup import actor_states

        described = {"dead": "died", "silent": "is not answering"}
        states = [f"engine {index} {described[state]}"
                  for index, state in enumerate(actor_states(self.engines, 5.0)) if state in described]
        return "; ".join(states) if states else "every engine answers (an actor rank failed?)"
