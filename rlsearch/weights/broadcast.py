"""The broadcast transport: per pipeline stage, a torch.distributed group of that stage's sender (rank 0) and every
worker of every engine (engine i's TP workers at `rank_offsets`), gloo on CPU and nccl on GPU: the same code
(process_group.py), each broadcast bounded by the sync's deadline.

The sender drives its stage: for each bucket it asks every engine to receive (a Ray call that blocks in the
engine workers' `broadcast`), broadcasts the flat buffer, and waits for every engine to have loaded it. Buckets
never pass through the driver or the object store; the sender holds at most one flat buffer besides the tensors
of the bucket being built. Stages run one after another (no two stages broadcast into the same engines at once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.distributed as dist

from .bucket import flatten_tensors, iter_buckets
from .clock import PhaseClock
from .deadline import Deadline
from .process_group import broadcast_within, group_device, rank_offsets
from .transport import SentWeights


class BroadcastTransport:
    """The driver's side: the groups (`BroadcastGroups`), then each stage's sender drives its broadcasts, stage by
    stage in pipeline order."""

    def __init__(self, bucket_bytes: int, engine_tp: int) -> None:
        self.bucket_bytes = bucket_bytes
        self.engine_tp = engine_tp
        self._groups = BroadcastGroups()

    def send(self, stages: Sequence[Sequence], engines: Sequence, held: list[str | None], deadline: Deadline,
             pause: Callable[[], None]) -> SentWeights:
        self._groups.ensure([workers[0] for workers in stages], engines, self.engine_tp, deadline)
        pause()
        # stage by stage: no two stages broadcast into the same engines at once
        return SentWeights([
            send_stage(stage, workers, engines, self.bucket_bytes, deadline) for stage, workers in enumerate(stages)
        ])

    def finished(self, sent: SentWeights) -> None:
        pass

    def failed(self) -> None:
        self._groups.invalidate()  # a broadcast past the deadline aborted its group

    def close(self, stages: Sequence[Sequence], engines: Sequence, deadline: Deadline) -> None:
        self._groups.leave([workers[0] for workers in stages], engines, deadline)


class BroadcastGroups:
    """The driver's view of the groups: made for one set of engines, made again when that set changes (an engine
    restarted) or after a sync failed (a failed broadcast aborts its group)."""

    def __init__(self) -> None:
        self._members: tuple | None = None

    def ensure(self, senders: Sequence, engines: Sequence, engine_tp: int, deadline: Deadline) -> None:
        """Create stage k's group for every k (in stage order: concurrent rendezvous across stages could
        interleave), unless these engines are already members."""
        members = tuple(engines)
        if members == self._members:
            return
        if self._members is not None:
            self.leave(senders, [engine for engine in self._members if engine in engines], deadline)
        offsets = rank_offsets([engine_tp] * len(engines))
        world = 1 + engine_tp * len(engines)
        for stage, sender in enumerate(senders):
            (address,) = deadline.get([sender.open_rendezvous.remote(f"weights-{stage}", deadline.timeout_s)],
                                      f"opening the rendezvous of stage {stage}'s broadcast group")
            joins = [
                engine.join_weight_group.remote(address, offset, world, stage, deadline.timeout_s)
                for engine, offset in zip(engines, offsets)
            ]
            created = sender.join_weight_group.remote(address, world, deadline.timeout_s)
            deadline.get([*joins, created], f"forming the broadcast group of stage {stage}", [*engines, None])
        self._members = members

    def invalidate(self) -> None:
        """A sync failed (a broadcast past its deadline aborts its group): the next sync forms every group anew, each
        member replacing its old one."""
        self._members = None

    def leave(self, senders: Sequence, engines: Sequence, deadline: Deadline) -> None:
        refs = [engine.leave_weight_groups.remote() for engine in engines]
        refs += [sender.leave_weight_groups.remote() for sender in senders]
        deadline.get(refs, "leaving the broadcast groups")
        self._members = None


def send_stage(stage: int, stage_workers: Sequence, engines: Sequence, bucket_bytes: int,
               deadline: Deadline) -> dict:
    """One stage's weights into every engine; ``stage_workers``: its DP-rank-0 ranks, the sender first."""
    refs = [stage_workers[0].broadcast_weights.remote(stage, list(engines), bucket_bytes, deadline.remaining())]
    refs += [worker.export_weights_as_peer.remote() for worker in stage_workers[1:]]
    return deadline.get(refs, f"broadcasting stage {stage}'s weights")[0]


def broadcast_buckets(named_tensors, group, stage: int, engines: Sequence, bucket_bytes: int,
                      timeout_s: float) -> dict:
    """The sender's side (an actor rank): bucket, flatten, ask every engine to receive, broadcast, wait for them.
    Returns the buckets, tensors and payload bytes sent and the seconds of each phase."""
    device = group_device(dist.get_backend(group))
    deadline = Deadline(timeout_s, engines)
    clock = PhaseClock()
    sent = {"buckets": 0, "tensors": 0, "bytes": 0, "wire_bytes": 0}
    for tensors in iter_buckets(clock.timed("export", named_tensors), bucket_bytes):
        with clock.phase("pack"):
            layout, flat = flatten_tensors(tensors, device)
        with clock.phase("transfer"):
            receives = [engine.receive_weight_broadcast.remote(stage, layout.to_wire()) for engine in engines]
            broadcast_within(flat, group, deadline.remaining())
            deadline.get(receives, "receiving a broadcast weight bucket", engines)
        del flat
        sent["buckets"] += 1
        sent["tensors"] += len(tensors)
        sent["bytes"] += layout.payload_bytes
        sent["wire_bytes"] += layout.total_bytes
    sent["phases"] = clock.seconds
    return sent
