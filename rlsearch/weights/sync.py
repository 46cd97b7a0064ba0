"""The driver's side of a weight sync: one export of the actor's weights into every rollout engine.

1. every engine opens the sync (dropping what a failed one left) and says which delta base it holds;
2. every engine pauses (requests kept) and opens a reload session;
3. each pipeline stage's sender (DP rank 0, TP rank 0) sends its own layers through the transport
   (`bridge.transport`): shm (shared-memory files, the stages at once) or broadcast (torch.distributed, stage by
   stage in pipeline order);
4. every engine closes its session (each parameter loaded, no HF name twice), resets its prefix cache and resumes.
With the shm transport and `bridge.stage_while_generating`, step 3's buckets are staged on the engines' nodes
before step 2, while the engines keep generating: they pause only to load them and finish. With `bridge.delta` the
buckets go through Ray's object store delta-encoded (`delta.py`), whole every `bridge.delta_full_every`-th sync
and whenever an engine or a sender does not hold the last sync's weights.
Every wait is bounded by `bridge.timeout_s`; a sync that cannot finish raises `WeightSyncError` naming the engines
that did not answer, and leaves the engines paused. The next sync forms the broadcast groups anew.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from . import broadcast, shm
from .clock import add_phases, worst_phases
from .deadline import Deadline, WeightSyncError


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
    """Syncs ``actor_group``'s weights into engines (RolloutWorker handles) with the transport of `bridge`;
    ``delta``, ``delta_full_every`` and ``stage_while_generating`` as `bridge.*` (shm transport only)."""

    def __init__(self, actor_group, bucket_mb: float, transport: str, timeout_s: float, engine_tp: int, *,
                 delta: bool = False, delta_full_every: int = 10, stage_while_generating: bool = False) -> None:
        if transport not in ("shm", "broadcast"):
            raise ValueError(f"unknown weight transport {transport!r} (shm | broadcast)")
        if delta and transport != "shm":
            raise ValueError("delta syncs (bridge.delta) need bridge.transport=shm")
        self.actor = actor_group
        self.bucket_bytes = int(bucket_mb * 1024 * 1024)
        self.transport = transport
        self.timeout_s = timeout_s
        self.engine_tp = engine_tp
        self.delta = delta
        self.delta_full_every = delta_full_every
        self.stage_first = stage_while_generating and transport == "shm"
        self._groups = broadcast.BroadcastGroups()
        self._placement: tuple[tuple, bool] | None = None  # (engines, whether they share every sender's node)
        self._synced_id: str | None = None  # the weights every engine and sender hold after the last delta-mode sync
        self._deltas_since_full = 0
        self._whole_model_bytes = 0  # what a stage-first sync stages (counted once)
        self._room_checked: tuple | None = None  # the engines and staging place /dev/shm was checked for

    def sync(self, engines: Sequence) -> SyncStats:
        started = time.perf_counter()
        deadline = Deadline(self.timeout_s, engines)
        stages = self.actor.stage_workers()
        held = deadline.get([engine.weight_rpc.remote("open_sync") for engine in engines], "opening the sync", engines)
        plan = None
        try:
            if self.transport == "broadcast":
                self._groups.ensure([workers[0] for workers in stages], engines, self.engine_tp, deadline)
                self._pause(engines, deadline)
                # stage by stage: no two stages broadcast into the same engines at once
                sent = [broadcast.send_stage(stage, workers, engines, self.bucket_bytes, deadline)
                        for stage, workers in enumerate(stages)]
            else:
                # deltas are applied by each engine's host, so they travel through the object store
                same_node = not self.delta and self._on_senders_node(stages, engines, deadline)
                plan = self._delta_plan(shm.ExportPlan(self.bucket_bytes, same_node, keep_staged=self.stage_first),
                                        stages, held, deadline)
                # a sync stages what the one before it did, in the same files: /dev/shm is checked once
                room_key = (tuple(engines), plan.stage_in_shared_memory)
                sent = shm.send_stages(stages, engines, plan, deadline, lambda: self._pause(engines, deadline),
                                       self._model_bytes(stages, deadline) if self.stage_first else 0,
                                       check_room=room_key != self._room_checked)
                self._room_checked = room_key
            sync_id = plan.sync_id if plan is not None else None
            engine_phases = deadline.get([engine.weight_rpc.remote("finish", sync_id) for engine in engines],
                                         "finishing the update", engines)
        except WeightSyncError:
            self._groups.invalidate()  # a broadcast past the deadline aborted its group
            self._synced_id = None
            raise
        delta = plan is not None and plan.delta_of is not None
        if plan is not None and plan.sync_id is not None:
            self._synced_id = plan.sync_id
            self._deltas_since_full = self._deltas_since_full + 1 if delta else 0
        phases = worst_phases(engine_phases)
        for stage_sent in sent:
            add_phases(phases, stage_sent["phases"])
        return SyncStats(
            seconds=time.perf_counter() - started, num_buckets=sum(s["buckets"] for s in sent),
            num_tensors=sum(s["tensors"] for s in sent), num_bytes=sum(s["bytes"] for s in sent),
            stage_bytes=[s["bytes"] for s in sent], num_engines=len(engines), phases=phases,
            wire_bytes=sum(s["wire_bytes"] for s in sent), delta=delta,
        )

    @staticmethod
    def _pause(engines: Sequence, deadline: Deadline) -> None:
        deadline.get([engine.weight_rpc.remote("begin") for engine in engines], "pausing the engines", engines)

    def _delta_plan(self, plan: shm.ExportPlan, stages: list[list], held: list, deadline: Deadline) -> shm.ExportPlan:
        """Under bridge.delta: this sync's id, and a delta against the last one's weights where every engine and
        sender still holds them and no full sync is due."""
        if not self.delta:
            return plan
        senders_hold = deadline.get([workers[0].delta_base_id.remote() for workers in stages],
                                    "asking the senders which weights they last sent")
        base = self._synced_id
        due_full = self._deltas_since_full + 1 >= self.delta_full_every
        delta_of = None if base is None or due_full or any(h != base for h in [*held, *senders_hold]) else base
        return replace(plan, sync_id=uuid.uuid4().hex, delta_of=delta_of)

    def _model_bytes(self, stages: list[list], deadline: Deadline) -> int:
        if not self._whole_model_bytes:
            sizes = deadline.get([worker.export_bytes.remote() for workers in stages for worker in workers],
                                 "asking the actor ranks for their weights' size")
            self._whole_model_bytes = sum(sizes)
        return self._whole_model_bytes

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
