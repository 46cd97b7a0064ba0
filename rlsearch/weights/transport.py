"""What a transport is to the driver's sync (sync.py): one object per run, `ShmTransport` (shm.py) or
`BroadcastTransport` (broadcast.py), chosen once from `weights.transport`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from .deadline import Deadline


@dataclass
class SentWeights:
    """What one sync sent: per pipeline stage its buckets, tensors, payload bytes, bytes moved and sender's phase
    seconds; and, under weights.delta, the id of the weights the engines hold once they finish it."""

    stages: list[dict]
    sync_id: str | None = None
    delta: bool = False  # whether the buckets carried only the changes since the last sync


class WeightTransport(Protocol):
    def send(self, stages: Sequence[Sequence], engines: Sequence, held: list[str | None], deadline: Deadline,
             pause: Callable[[], None]) -> SentWeights:
        """Every stage's weights into every opened engine (`held`: the delta base each engine holds), calling
        `pause` once before the engines must stand still."""
        ...

    def finished(self, sent: SentWeights) -> None:
        """Every engine finished the sync that sent `sent`."""
        ...

    def failed(self) -> None:
        """A sync failed part-way: nothing it set up can be trusted by the next one."""
        ...

    def close(self, stages: Sequence[Sequence], engines: Sequence, deadline: Deadline) -> None:
        """Release what the transport holds in the ranks and engines (before either goes away)."""
        ...
