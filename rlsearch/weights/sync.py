"""The driver's side of a weight sync: one export of the actor's weights into every rollout engine.

1. every engine pauses (requests kept) and opens a reload session;
2. each pipeline stage's sender (DP rank 0, TP rank 0) sends its own layers through the transport
   (`bridge.transport`): shm (shared-memory files, the stages at once) or broadcast (torch.distributed, stage by
   stage in pipeline order);
3. every engine closes its session (each parameter loaded, no HF name twice), resets its prefix cache and resumes.
Every wait is bounded by `bridge.timeout_s`; a sync that cannot finish raises `WeightSyncError` naming the engines
that did not answer, and leaves the engines paused. The next sync forms the broadcast groups anew.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from . import broadcast, shm
from .clock import add_phases, worst_phases
from .deadline import Deadline, WeightSyncError


@dataclass
class SyncStats:
    seconds: float
    num_buckets: int
    num_tensors: int  # HF tensors each engine received
    num_bytes: int  # payload bytes each engine received
    stage_bytes: list[int] = field(default_factory=list)  # payload bytes each pipeline stage's sender sent
    num_engines: int = 0
    # seconds per phase (rlsearch.weights.clock.PHASES): the senders' summed over stages, the engines' of the worst
    # engine; "pause" is how long the engines stood still
    phases: dict[str, float] = field(default_factory=dict)


class WeightSync:
    """Syncs ``actor_group``'s weights into engines (RolloutWorker handles) with the transport of `bridge`."""

    def __init__(self, actor_group, bucket_mb: float, transport: str, timeout_s: float, engine_tp: int) -> None:
        if transport not in ("shm", "broadcast"):
            raise ValueError(f"unknown weight transport {transport!r} (shm | broadcast)")
        self.actor = actor_group
        self.bucket_bytes = int(bucket_mb * 1024 * 1024)
        self.transport = transport
        self.timeout_s = timeout_s
        self.engine_tp = engine_tp
        self._groups = broadcast.BroadcastGroups()
        self._placement: tuple[tuple, bool] | None = None  # (engines, whether they share every sender's node)

    def sync(self, engines: Sequence) -> SyncStats:
        started = time.perf_counter()
        deadline = Deadline(self.timeout_s, engines)
        stages = self.actor.stage_workers()
        try:
            if self.transport == "broadcast":
                self._groups.ensure([workers[0] for workers in stages], engines, self.engine_tp, deadline)
            deadline.get([engine.weight_rpc.remote("begin") for engine in engines], "pausing the engines", engines)
            if self.transport == "broadcast":  # stage by stage: no two stages broadcast into the same engines at once
                sent = [broadcast.send_stage(stage, workers, engines, self.bucket_bytes, deadline)
                        for stage, workers in enumerate(stages)]
            else:
                same_node = self._on_senders_node(stages, engines, deadline)
                sent = shm.send_stages(stages, engines, self.bucket_bytes, deadline, same_node)
        except WeightSyncError:
            self._groups.invalidate()  # a broadcast past the deadline aborted its group
            raise
        engine_phases = deadline.get([engine.weight_rpc.remote("finish") for engine in engines],
                                     "finishing the update", engines)
        phases = worst_phases(engine_phases)
        for stage_sent in sent:
            add_phases(phases, stage_sent["phases"])
        return SyncStats(
            seconds=time.perf_counter() - started, num_buckets=sum(s["buckets"] for s in sent),
            num_tensors=sum(s["tensors"] for s in sent), num_bytes=sum(s["bytes"] for s in sent),
            stage_bytes=[s["bytes"] for s in sent], num_engines=len(engines), phases=phases,
        )

    def _on_senders_node(self, stages: list[list], engines: Sequence, deadline: Deadline) -> bool:
        """Whether every engine runs on the node of every stage's sender (then buckets are staged there once)."""
        if self._placement is None or self._placement[0] != tuple(engines):
            refs = [workers[0].node_id.remote() for workers in stages] + [e.node_id.remote() for e in engines]
            nodes = set(deadline.get(refs, "asking where the senders and engines run"))
            self._placement = (tuple(engines), len(nodes) == 1)
        return self._placement[1]

    def close(self, engines: Sequence) -> None:
        """Leave the broadcast groups (before the engines or the actor go away)."""
        if self.transport == "broadcast":
            stages = self.actor.stage_workers()
            self._groups.leave([workers[0] for workers in stages], engines, Deadline(self.timeout_s, engines))
