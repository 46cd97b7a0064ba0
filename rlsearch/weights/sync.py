"""The driver's side of a weight sync: one export of the actor's weights into every rollout engine.

1. every engine opens the sync (dropping what a failed one left) and says which delta base it holds;
2. every engine pauses (requests kept) and opens a reload session;
3. each pipeline stage's sender (DP rank 0, TP rank 0) sends its own layers through the transport
   (`weights.transport`, one `WeightTransport` chosen at start-up): `ShmTransport` (shared-memory files, the stages
   at once) or `BroadcastTransport` (torch.distributed, stage by stage in pipeline order);
4. every engine closes its session (each parameter loaded, no HF name twice), resets its prefix cache and resumes.
With the shm transport and `weights.stage_while_generating`, step 3's buckets are staged on the engines' nodes
before step 2, while the engines keep generating: they pause only to load them and finish. With `weights.delta` the
buckets go through Ray's object store delta-encoded (`delta.py`), whole every `weights.delta_full_every`-th sync
and whenever an engine or a sender does not hold the last sync's weights.
Every wait is bounded by `weights.timeout_s`; a sync that cannot finish raises `WeightSyncError` naming the engines
that did not answer, and leaves the engines paused. The next sync forms the broadcast groups anew.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from .broadcast import BroadcastTransport
from .clock import add_phases, worst_phases
from .deadline import Deadline, WeightSyncError
from .shm import ShmTransport
from .transport import WeightTransport


@dataclass
class SyncStats:
    seconds: float
    num_buckets: int
    num_tensors: int  # HF tensors each engine received
    num_bytes: int  # payload bytes each engine received (the whole tensors)
    stage_bytes: list[int] = field(default_factory=list)  # payload bytes each pipeline stage's sender sent
    num_engines: int = 0
    # seconds per phase (rlsearch.weights.clock.PHASES): the senders' summed over stages, the engines' of the worst
    # engine; "pause" is how long the engines stood still
    phases: dict[str, float] = field(default_factory=dict)
    wire_bytes: int = 0  # bytes the senders' buckets took (a delta sync: the encoded changes) for each engine
    delta: bool = False  # whether the buckets carried only the changes since the last sync


class WeightSync:
    """Syncs ``actor_ranks``'s weights into engines (RolloutWorker handles) with the transport of `weights`;
    ``delta``, ``delta_full_every`` and ``stage_while_generating`` as `weights.*` (shm transport only)."""

    def __init__(self, actor_ranks, bucket_mb: float, transport: str, timeout_s: float, engine_tp: int, *,
                 delta: bool = False, delta_full_every: int = 10, stage_while_generating: bool = False) -> None:
        self.actor = actor_ranks
        self.timeout_s = timeout_s
        bucket_bytes = int(bucket_mb * 1024 * 1024)
        # weights.transport concrete (rlsearch.config.auto): the config refuses delta syncs over broadcast
        self.transport: WeightTransport = BroadcastTransport(bucket_bytes, engine_tp) if transport == "broadcast" \
            else ShmTransport(bucket_bytes, delta, delta_full_every, stage_first=stage_while_generating)

    def sync(self, engines: Sequence, version: int | None = None) -> SyncStats:
        """The actor's weights into `engines`, which then report them as policy version `version` (None: each
        counts one more)."""
        started = time.perf_counter()
        deadline = Deadline(self.timeout_s, engines)
        stages = self.actor.stage_workers()
        held = deadline.get([engine.open_weight_sync.remote() for engine in engines], "opening the sync", engines)
        try:
            sent = self.transport.send(stages, engines, held, deadline, lambda: self._pause(engines, deadline))
            finishing = [engine.finish_weight_sync.remote(sent.sync_id, version) for engine in engines]
            engine_phases = deadline.get(finishing, "finishing the update", engines)
        except WeightSyncError:
            self.transport.failed()
            raise
        self.transport.finished(sent)
        phases = worst_phases(engine_phases)
        for stage_sent in sent.stages:
            add_phases(phases, stage_sent["phases"])
        return SyncStats(
            seconds=time.perf_counter() - started, num_buckets=sum(s["buckets"] for s in sent.stages),
            num_tensors=sum(s["tensors"] for s in sent.stages), num_bytes=sum(s["bytes"] for s in sent.stages),
            stage_bytes=[s["bytes"] for s in sent.stages], num_engines=len(engines), phases=phases,
            wire_bytes=sum(s["wire_bytes"] for s in sent.stages), delta=sent.delta,
        )

    def replace_senders(self, actor_ranks) -> None:
        """New actor ranks send from now on (the old ones died): the next sync is a whole one, and the broadcast
        transport forms its groups anew."""
        self.actor = actor_ranks
        self.transport.failed()

    @staticmethod
    def _pause(engines: Sequence, deadline: Deadline) -> None:
        deadline.get([engine.pause_for_weights.remote() for engine in engines], "pausing the engines", engines)

    def close(self, engines: Sequence) -> None:
        """Release what the transport holds (the broadcast groups) before the engines or the actor go away."""
        self.transport.close(self.actor.stage_workers(), engines, Deadline(self.timeout_s, engines))
