"""The shm transport: buckets in shared memory, mapped by every engine.

Where a stage's sender and the engines share a node (a one-node run), the sender writes each bucket once, in the
flat form, to a file in /dev/shm, and the TP workers of every engine map that same file: one copy per bucket
whatever the number of engines. Where they do not (trainer.placement=split), buckets travel through Ray's object
store and each engine's host stages them in a /dev/shm file of its own.

A file in /dev/shm is memory: writing a mapped page past a full tmpfs kills the writer (SIGBUS), and containers get
64 MB by default. So before each sync a process on every node that stages buckets checks that its /dev/shm has
room for them, and the sync stops with an error saying how much it needs and how to get it.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import tempfile
from collections import deque
from collections.abc import Sequence

import numpy as np
import ray
import torch

from ..config import ConfigError
from .bucket import flatten_tensors, iter_buckets, pack_bucket
from .clock import PhaseClock
from .deadline import Deadline

STAGING_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
# weight buckets a sender may have produced ahead of the engines: bounds its extra memory
BUCKETS_IN_FLIGHT = 2
# a sender's staged files kept: when it stages bucket j the driver has taken bucket j-2 from the stream, which it
# does only once every engine loaded bucket j-3; older files are no longer read
STAGED_FILES_KEPT = BUCKETS_IN_FLIGHT + 1
# a sender writes its next file before it removes the oldest one it keeps
SENDER_FILES_AT_ONCE = STAGED_FILES_KEPT + 1


class StagingSpaceError(ConfigError):
    """The staging directory (/dev/shm) of a node has no room for the weight buckets a sync would stage there."""


def check_staging_space(directory: str, bytes_needed: int, what: str) -> None:
    """StagingSpaceError unless `directory` has `bytes_needed` bytes free; `what` says which files need them."""
    free = shutil.disk_usage(directory).free
    if free >= bytes_needed:
        return
    gib = 2**30
    # the size suggested keeps a GiB more for what else lives there (vLLM's message queues, NCCL, Ray)
    raise StagingSpaceError(
        f"weight sync (bridge.transport=shm): {directory} on {socket.gethostname()} has {free / gib:.2f} GiB free, "
        f"but {what} need {bytes_needed / gib:.2f} GiB, and a full {directory} kills the process writing to it. "
        f"Give it room (Docker: --shm-size={math.ceil(bytes_needed / gib) + 1}g; Kubernetes: an emptyDir with medium: "
        "Memory mounted at /dev/shm), lower bridge.bucket_mb, or set bridge.transport=broadcast, which stages nothing "
        "there"
    )


def _check_staging_space_in(_actor, bytes_needed: int, what: str) -> None:
    """`check_staging_space` of this node's STAGING_DIR, run inside a Ray actor on that node (`__ray_call__`)."""
    check_staging_space(STAGING_DIR, bytes_needed, what)


def check_staging_room(stages: Sequence[Sequence], engines: Sequence, bucket_bytes: int, deadline: Deadline,
                       same_node: bool) -> None:
    """Before a sync stages anything: StagingSpaceError unless every node's /dev/shm holds what it will stage there,
    checked by an actor on that node. On the senders' node (`same_node`) each stage's sender keeps
    SENDER_FILES_AT_ONCE buckets; otherwise each engine stages one bucket at a time on its own node. A tensor larger
    than a bucket travels alone, so this is the need for bridge.bucket_mb-sized buckets."""
    mib = f"{bucket_bytes / 2**20:g} MiB (bridge.bucket_mb)"
    if same_node:
        checks = [(stages[0][0], len(stages) * SENDER_FILES_AT_ONCE * bucket_bytes,
                   f"{len(stages)} sender(s) x {SENDER_FILES_AT_ONCE} staged buckets x {mib}")]
    else:
        nodes = deadline.get([engine.node_id.remote() for engine in engines], "asking where the engines run", engines)
        by_node: dict[str, list] = {}
        for engine, node in zip(engines, nodes):
            by_node.setdefault(node, []).append(engine)
        checks = [(members[0], len(members) * bucket_bytes, f"{len(members)} engine(s) x 1 staged bucket x {mib}")
                  for members in by_node.values()]
    # any actor runs a function on request (Ray's __ray_call__): no method of its own needed for a look at its node
    refs = [handle.__ray_call__.remote(_check_staging_space_in, need, what) for handle, need, what in checks]
    deadline.wait(refs, "checking the room in /dev/shm")
    for ref in refs:
        try:
            ray.get(ref)
        except ray.exceptions.RayTaskError as error:
            if isinstance(error.cause, StagingSpaceError):
                raise error.cause from None
            raise


def send_stages(stages: Sequence[Sequence], engines: Sequence, bucket_bytes: int, deadline: Deadline,
                same_node: bool) -> list[dict[str, int]]:
    """Every bucket of every pipeline stage into every engine. ``stages[k]``: stage k's DP-rank-0 ranks, its sender
    (TP rank 0) first; each runs `stream_buckets`. The stages export at the same time (each sender at most
    BUCKETS_IN_FLIGHT buckets ahead) and the engines load whichever bucket is ready first: a reload session takes
    a layer's tensors in any order. Returns each stage's buckets, tensors, payload bytes and its sender's phase
    seconds."""
    check_staging_room(stages, engines, bucket_bytes, deadline, same_node)
    streams = [
        [
            worker.export_weight_buckets.options(
                num_returns="streaming", _generator_backpressure_num_objects=BUCKETS_IN_FLIGHT
            ).remote(bucket_bytes, same_node)
            for worker in workers
        ]
        for workers in stages
    ]
    load = "load_staged" if same_node else "load_bucket"
    sent = [{"buckets": 0, "tensors": 0, "bytes": 0} for _ in stages]
    exporting = {stage: stage_streams[0] for stage, stage_streams in enumerate(streams)}
    while exporting:
        ready, _ = ray.wait(list(exporting.values()), num_returns=1, timeout=deadline.remaining())
        if not ready:
            deadline.wait(list(exporting.values()), "the actor stages' senders to export their next weight bucket")
        stage = next(stage for stage, stream in exporting.items() if stream is ready[0])
        try:
            bucket_ref = next(exporting[stage])
        except StopIteration:
            del exporting[stage]
            continue
        loads = [engine.weight_rpc.remote(load, bucket_ref) for engine in engines]
        tensors, nbytes = deadline.get(loads, "loading a weight bucket", engines)[0]
        sent[stage]["buckets"] += 1
        sent[stage]["tensors"] += tensors
        sent[stage]["bytes"] += nbytes
    for stage_streams in streams:  # the TP peers yield nothing; their end says they finished cleanly
        for stream in stage_streams[1:]:
            deadline.wait([stream], "the actor stages' TP peers to finish the export")
            for _ in stream:
                pass
    phases = deadline.get([workers[0].send_phases.remote() for workers in stages], "the senders' phase times")
    for stage_sent, stage_phases in zip(sent, phases):
        stage_sent["phases"] = stage_phases
    if same_node:
        releases = [workers[0].release_staged_buckets.remote() for workers in stages]
        deadline.get(releases, "removing the staged bucket files")
    return sent


class StagedBuckets:
    """A sender's bucket files in shared memory (flat form), the newest `STAGED_FILES_KEPT` kept."""

    def __init__(self) -> None:
        self.paths: deque[str] = deque()

    def stage(self, tensors: list[tuple[str, torch.Tensor]]) -> dict:
        """Write one bucket to a new file; returns what an engine needs to map it (path and layout)."""
        descriptor, path = tempfile.mkstemp(prefix="rlsearch-bucket-", dir=STAGING_DIR)
        os.close(descriptor)
        self.paths.append(path)

        def mapped(total_bytes: int) -> torch.Tensor:
            if not total_bytes:
                return torch.empty(0, dtype=torch.uint8)
            return torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="w+", shape=(total_bytes,)))

        layout, _ = flatten_tensors(tensors, torch.device("cpu"), allocate=mapped)
        while len(self.paths) > STAGED_FILES_KEPT:
            os.unlink(self.paths.popleft())
        return {"path": path, "layout": layout.to_wire()}

    def release(self) -> None:
        while self.paths:
            path = self.paths.popleft()
            if os.path.exists(path):
                os.unlink(path)


def stream_buckets(named_tensors, bucket_bytes: int, is_sender: bool, staged: StagedBuckets | None,
                   clock: PhaseClock):
    """The actor rank's side: its stage's HF tensors in buckets, yielded by the sender (as staged files when
    ``staged`` is given, else as object-store buckets); TP peers only take part in the gathers. The sender's
    export and pack seconds go to `clock`."""
    if not is_sender:
        for _ in named_tensors:
            pass
        return
    for tensors in iter_buckets(clock.timed("export", named_tensors), bucket_bytes):
        with clock.phase("pack"):
            bucket = staged.stage(tensors) if staged is not None else pack_bucket(tensors)
        yield bucket
