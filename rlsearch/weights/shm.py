"""The shm transport: buckets in shared memory, mapped by every engine.

Where a stage's sender and the engines share a node (a one-node run), the sender writes each bucket once, in the
flat form, to a file in /dev/shm, and the TP workers of every engine map that same file: one copy per bucket
whatever the number of engines. Where they do not (trainer.placement=split), buckets travel through Ray's object
store and each engine's host stages them in a /dev/shm file of its own.

A file in /dev/shm is memory: writing a mapped page past a full tmpfs kills the writer (SIGBUS), and containers get
64 MB by default. So before the first sync (and whenever the engines change) a process on every node that stages
buckets checks that its /dev/shm has room for them, and the sync stops with an error saying how much it needs and
how to get it. A sender keeps its files and rewrites them every sync (`StagedBuckets`), so later syncs need no new
room.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError
from ..lifetime import files_of_gone_owners, owned_file_name
from .bucket import flatten_tensors, iter_buckets, pack_bucket
from .clock import PhaseClock
from .deadline import Deadline
from .delta import DeltaEncoder
from .transport import SentWeights

STAGING_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
# weight buckets a sender may have produced ahead of the engines: bounds its extra memory
BUCKETS_IN_FLIGHT = 2
# a sender's staged files kept: when it stages bucket j the driver has taken bucket j-2 from the stream, which it
# does only once every engine loaded bucket j-3; older files are no longer read
STAGED_FILES_KEPT = BUCKETS_IN_FLIGHT + 1
# a sender writes its next file before it removes the oldest one it keeps
SENDER_FILES_AT_ONCE = STAGED_FILES_KEPT + 1
SENDER_FILE_PREFIX = "rlsearch-sender-"  # + host-pid-index: a sender's bucket files (`StagedBuckets`)


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
        f"weight sync (weights.transport=shm): {directory} on {socket.gethostname()} has {free / gib:.2f} GiB free, "
        f"but {what} need {bytes_needed / gib:.2f} GiB, and a full {directory} kills the process writing to it. "
        f"Give it room (Docker: --shm-size={math.ceil(bytes_needed / gib) + 1}g; Kubernetes: an emptyDir with medium: "
        "Memory mounted at /dev/shm), lower weights.bucket_mb, or set weights.transport=broadcast, which stages "
        "nothing there"
    )


def reserved_mapping(path: str, size: int) -> np.memmap:
    """A new file of `size` bytes at `path`, its pages reserved, mapped for reading and writing. Reserving them up
    front turns a full tmpfs into an OSError (ENOSPC) here, where a write to a mapped page would kill the process."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(descriptor, 0, size)
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(descriptor)
    return np.memmap(path, dtype=np.uint8, mode="r+", shape=(size,))


def _check_staging_space_in(_actor, bytes_needed: int, what: str) -> None:
    """`check_staging_space` of this node's STAGING_DIR, run inside a Ray actor on that node (`__ray_call__`)."""
    check_staging_space(STAGING_DIR, bytes_needed, what)


def check_staging_room(stages: Sequence[Sequence], engines: Sequence, bucket_bytes: int, deadline: Deadline,
                       same_node: bool, whole_model_bytes: int = 0) -> None:
    """Before a sync stages anything: StagingSpaceError unless every node's /dev/shm holds what it will stage there,
    checked by an actor on that node. On the senders' node (`same_node`) each stage's sender keeps
    SENDER_FILES_AT_ONCE buckets; otherwise each engine stages one bucket at a time on its own node. Staged first
    (`whole_model_bytes` > 0), each place keeps the whole model instead. A tensor larger than a bucket travels alone,
    so this is the need for weights.bucket_mb-sized buckets."""
    import ray

    mib = f"{bucket_bytes / 2**20:g} MiB (weights.bucket_mb)"
    whole = f"the whole model ({whole_model_bytes / 2**30:.2f} GiB, weights.stage_while_generating)"
    if same_node:
        need, what = len(stages) * SENDER_FILES_AT_ONCE * bucket_bytes, \
            f"{len(stages)} sender(s) x {SENDER_FILES_AT_ONCE} staged buckets x {mib}"
        if whole_model_bytes:
            need, what = whole_model_bytes, f"the senders' staged buckets, {whole}"
        checks = [(stages[0][0], need, what)]
    else:
        nodes = deadline.get([engine.node_id.remote() for engine in engines], "asking where the engines run", engines)
        by_node: dict[str, list] = {}
        for engine, node in zip(engines, nodes):
            by_node.setdefault(node, []).append(engine)
        per_engine, each = (whole_model_bytes, whole) if whole_model_bytes else \
            (bucket_bytes, f"1 staged bucket x {mib}")
        checks = [(members[0], len(members) * per_engine, f"{len(members)} engine(s) x {each}")
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


@dataclass(frozen=True)
class ExportPlan:
    """What a stage's ranks do in one shm sync (`export_weight_buckets`)."""

    bucket_bytes: int
    stage_in_shared_memory: bool  # the sender writes flat files in /dev/shm (engines on its node) or yields buckets
    keep_staged: bool = False  # staged first: the sender writes every bucket to its own file (no file reused)
    sync_id: str | None = None  # weights.delta: this sync's id; buckets are delta-encoded (None: no delta encoding)
    delta_of: str | None = None  # weights.delta: the id of the weights every engine holds (None: send them whole)


class ShmTransport:
    """The driver's side: where the buckets go (the senders' node, or the object store), the delta bookkeeping of
    weights.delta, and the /dev/shm room check; `send_stages` moves the buckets. ``delta``, ``delta_full_every`` and
    ``stage_first`` (weights.stage_while_generating, with updates landing on rollouts in flight) as `weights.*`."""

    def __init__(self, bucket_bytes: int, delta: bool = False, delta_full_every: int = 10,
                 stage_first: bool = False) -> None:
        self.bucket_bytes = bucket_bytes
        self.delta = delta
        self.delta_full_every = delta_full_every
        self.stage_first = stage_first
        self._placement: tuple[tuple, bool] | None = None  # (engines, whether they share every sender's node)
        self._synced_id: str | None = None  # the weights every engine and sender hold after the last delta-mode sync
        self._deltas_since_full = 0
        self._whole_model_bytes = 0  # what a stage-first sync stages (counted once)
        self._room_checked: tuple | None = None  # the engines and staging place /dev/shm was checked for

    def send(self, stages: Sequence[Sequence], engines: Sequence, held: list[str | None], deadline: Deadline,
             pause: Callable[[], None]) -> SentWeights:
        # deltas are applied by each engine's host, so they travel through the object store
        same_node = not self.delta and self._on_senders_node(stages, engines, deadline)
        plan = self._delta_plan(ExportPlan(self.bucket_bytes, same_node, keep_staged=self.stage_first), stages, held,
                                deadline)
        # a sync stages what the one before it did, in the same files: /dev/shm is checked once
        room_key = (tuple(engines), plan.stage_in_shared_memory)
        sent = send_stages(stages, engines, plan, deadline, pause,
                           self._model_bytes(stages, deadline) if self.stage_first else 0,
                           check_room=room_key != self._room_checked)
        self._room_checked = room_key
        return SentWeights(sent, plan.sync_id, delta=plan.delta_of is not None)

    def finished(self, sent: SentWeights) -> None:
        if sent.sync_id is not None:
            self._synced_id = sent.sync_id
            self._deltas_since_full = self._deltas_since_full + 1 if sent.delta else 0

    def failed(self) -> None:
        self._synced_id = None

    def close(self, stages: Sequence[Sequence], engines: Sequence, deadline: Deadline) -> None:
        pass

    def _delta_plan(self, plan: ExportPlan, stages: Sequence[Sequence], held: list, deadline: Deadline) -> ExportPlan:
        """Under weights.delta: this sync's id, and a delta against the last one's weights where every engine and
        sender still holds them and no full sync is due."""
        if not self.delta:
            return plan
        senders_hold = deadline.get([workers[0].delta_base_id.remote() for workers in stages],
                                    "asking the senders which weights they last sent")
        base = self._synced_id
        due_full = self._deltas_since_full + 1 >= self.delta_full_every
        delta_of = None if base is None or due_full or any(h != base for h in [*held, *senders_hold]) else base
        return replace(plan, sync_id=uuid.uuid4().hex, delta_of=delta_of)

    def _model_bytes(self, stages: Sequence[Sequence], deadline: Deadline) -> int:
        if not self._whole_model_bytes:
            sizes = deadline.get([worker.export_bytes.remote() for workers in stages for worker in workers],
                                 "asking the actor ranks for their weights' size")
            self._whole_model_bytes = sum(sizes)
        return self._whole_model_bytes

    def _on_senders_node(self, stages: Sequence[Sequence], engines: Sequence, deadline: Deadline) -> bool:
        """Whether every engine runs on the node of every stage's sender (then buckets are staged there once)."""
        if self._placement is None or self._placement[0] != tuple(engines):
            refs = [workers[0].node_id.remote() for workers in stages] + [e.node_id.remote() for e in engines]
            nodes = set(deadline.get(refs, "asking where the senders and engines run"))
            self._placement = (tuple(engines), len(nodes) == 1)
        return self._placement[1]


def send_stages(stages: Sequence[Sequence], engines: Sequence, plan: ExportPlan, deadline: Deadline,
                pause: Callable[[], None], whole_model_bytes: int = 0, check_room: bool = True) -> list[dict[str, int]]:
    """Every bucket of every pipeline stage into every engine. ``stages[k]``: stage k's DP-rank-0 ranks, its sender
    (TP rank 0) first; each runs `stream_buckets`. The stages export at the same time (each sender at most
    BUCKETS_IN_FLIGHT buckets ahead) and the engines take whichever bucket is ready first: a reload session takes
    a layer's tensors in any order. `pause` pauses the engines: at once, or, staged first (`whole_model_bytes` > 0,
    the estimate the room check uses), once every bucket is staged on the engines' nodes, so that the engines go on
    generating while the senders export. `check_room`: check the room in /dev/shm first (`check_staging_room`; a
    sync that stages what an earlier one did reuses its files). Returns each stage's buckets, tensors, payload
    bytes, bytes moved and its sender's phase seconds."""
    stage_first = whole_model_bytes > 0
    same_node = plan.stage_in_shared_memory
    if check_room:
        check_staging_room(stages, engines, plan.bucket_bytes, deadline, same_node, whole_model_bytes)
    streams = [
        [
            worker.export_weight_buckets.options(
                num_returns="streaming", _generator_backpressure_num_objects=BUCKETS_IN_FLIGHT
            ).remote(plan)
            for worker in workers
        ]
        for workers in stages
    ]
    try:
        sent = _take_buckets(streams, engines, deadline, pause, stage_first, same_node)
    except BaseException:
        # an engine (or rank) failed part-way: the senders' exports run to their end, so that the actor ranks are
        # free (not blocked on buckets nobody takes) for the sync that follows a restart
        _drain([stream for stage_streams in streams for stream in stage_streams], min(deadline.remaining(), 60.0))
        raise
    phases = deadline.get([workers[0].send_phases.remote() for workers in stages], "the senders' phase times")
    for stage_sent, stage_phases in zip(sent, phases):
        stage_sent["phases"] = stage_phases
    return sent


def _stage_bucket(engine, bucket_ref):  # the engine writes it to its own staged files, generating on
    return engine.stage_weight_bucket.remote(bucket_ref)


def _load_staged_bucket(engine, bucket_ref):  # the bucket is a file on the engine's node
    return engine.load_staged_weight_bucket.remote(bucket_ref)


def _load_bucket(engine, bucket_ref):  # the bucket travels through the object store
    return engine.load_weight_bucket.remote(bucket_ref)


def _take_buckets(streams: list[list], engines: Sequence, deadline: Deadline, pause: Callable[[], None],
                  stage_first: bool, same_node: bool) -> list[dict]:
    """`send_stages`' loop over the senders' streams: each bucket into every engine at once, or, staged first, every
    bucket staged before `pause` and loaded after it. Returns each stage's buckets, tensors and bytes."""
    import ray

    if not stage_first:
        pause()
    # per bucket: the engines' call now (load it, or stage it on their node); staged first on the senders' node, the
    # bucket files wait to be loaded once paused
    take_now = None if stage_first and same_node else (
        _stage_bucket if stage_first else _load_staged_bucket if same_node else _load_bucket)
    sent = [{"buckets": 0, "tensors": 0, "bytes": 0, "wire_bytes": 0} for _ in streams]
    staged_files: list = []

    def count(stage: int, taken: tuple[int, int, int]) -> None:
        sent[stage]["buckets"] += 1
        for key, value in zip(("tensors", "bytes", "wire_bytes"), taken):
            sent[stage][key] += value

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
        if take_now is None:
            staged_files.append((stage, bucket_ref))
            continue
        calls = [take_now(engine, bucket_ref) for engine in engines]
        count(stage, deadline.get(calls, f"{'staging' if stage_first else 'loading'} a weight bucket", engines)[0])
    for stage_streams in streams:  # the TP peers yield nothing; their end says they finished cleanly
        for stream in stage_streams[1:]:
            deadline.wait([stream], "the actor stages' TP peers to finish the export")
            for _ in stream:
                pass
    if stage_first:
        pause()
        for stage, bucket_ref in staged_files:
            calls = [_load_staged_bucket(engine, bucket_ref) for engine in engines]
            count(stage, deadline.get(calls, "loading a staged weight bucket", engines)[0])
        if not same_node:
            calls = [engine.load_staged_weight_buckets.remote() for engine in engines]
            deadline.get(calls, "loading the staged weight buckets", engines)
    return sent


def _drain(streams: list, timeout_s: float) -> None:
    """Take and drop what `streams` still yield, for at most `timeout_s` seconds in all."""
    import ray

    end = time.monotonic() + timeout_s
    for stream in streams:
        try:
            while True:
                ready, _ = ray.wait([stream], num_returns=1, timeout=max(0.0, end - time.monotonic()))
                if not ready:
                    return
                next(stream)
        except StopIteration:
            continue
        except ray.exceptions.RayError:  # a rank that died: nothing to free there
            continue


class StagedBuckets:
    """A sender's bucket files in shared memory (flat form), mapped once and rewritten sync after sync: a bucket is
    copied into pages that already exist (a new file's pages cost more to fault in than the copy itself), and a
    model's buckets have the same sizes every sync. Bucket j of a sync goes to file j mod SENDER_FILES_AT_ONCE, or,
    staged first (`keep_all`), to file j. Files are named by the sender's pid: `close` removes them, and a new
    sender removes those of senders that died. A sender on a GPU page-locks each mapping once (cudaHostRegister):
    the device-to-host copy into pageable memory runs at a quarter of the speed (13 against 48 GB/s on an H100)."""

    def __init__(self) -> None:
        self.files: list[tuple[str, np.memmap]] = []  # (path, its mapping)
        self.keep_all = False
        self._next = 0
        self._pinned: dict[int, int] = {}  # file index -> address of its page-locked mapping
        self._pinning_failed = False
        self._remove_orphans()

    def start(self, keep_all: bool) -> None:
        """A sync begins: its first bucket goes to the first file."""
        self.keep_all = keep_all
        self._next = 0

    def stage(self, tensors: list[tuple[str, torch.Tensor]]) -> dict:
        """Write one bucket to the next file; returns what an engine needs to map it (path and layout)."""
        index = self._next if self.keep_all else self._next % SENDER_FILES_AT_ONCE
        self._next += 1
        while len(self.files) <= index:
            self.files.append((os.path.join(STAGING_DIR, owned_file_name(SENDER_FILE_PREFIX, len(self.files))), None))

        def mapped(total_bytes: int) -> torch.Tensor:
            path, mapping = self.files[index]
            if mapping is None or mapping.size < total_bytes:  # a new file, or a larger bucket than it held
                self._unpin(index)
                self.files[index] = (path, None)
                try:
                    mapping = reserved_mapping(path, max(total_bytes, 1))
                except OSError:
                    check_staging_space(STAGING_DIR, total_bytes, "the sender's next weight bucket file")
                    raise
                self.files[index] = (path, mapping)
            if index not in self._pinned and any(tensor.is_cuda for _, tensor in tensors):
                self._pin(index, mapping)
            return torch.from_numpy(mapping[:total_bytes])

        layout, _ = flatten_tensors(tensors, torch.device("cpu"), allocate=mapped)
        return {"path": self.files[index][0], "layout": layout.to_wire()}

    def _pin(self, index: int, mapping: np.memmap) -> None:
        if self._pinning_failed:
            return
        address = mapping.ctypes.data
        try:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(address, mapping.nbytes, 0))
        except RuntimeError as error:  # the copies still work, at pageable speed
            self._pinning_failed = True
            warnings.warn(f"cannot page-lock the weight bucket files in {STAGING_DIR} ({error}): device-to-host "
                          "copies into them run at pageable-memory speed", stacklevel=3)
            return
        self._pinned[index] = address

    def _unpin(self, index: int) -> None:
        address = self._pinned.pop(index, None)
        if address is not None:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(address))

    def close(self) -> None:
        while self.files:
            self._unpin(len(self.files) - 1)
            path, _ = self.files.pop()
            if os.path.exists(path):
                os.unlink(path)

    @staticmethod
    def _remove_orphans() -> None:
        """Remove the bucket files of senders on this host that are gone (killed mid-run)."""
        for path in files_of_gone_owners(Path(STAGING_DIR), SENDER_FILE_PREFIX):
            path.unlink(missing_ok=True)


def stream_buckets(named_tensors, plan: ExportPlan, is_sender: bool, staged: StagedBuckets | None,
                   encoder: DeltaEncoder | None, clock: PhaseClock):
    """The actor rank's side: its stage's HF tensors in buckets, yielded by the sender (as staged files when
    ``staged`` is given, else as object-store buckets, delta-encoded by ``encoder`` when given); TP peers only take
    part in the gathers. The sender's export and pack seconds go to `clock`."""
    if not is_sender:
        for _ in named_tensors:
            pass
        return
    for tensors in iter_buckets(clock.timed("export", named_tensors), plan.bucket_bytes):
        with clock.phase("pack"):
            if staged is not None:
                bucket = staged.stage(tensors)
            else:
                bucket = encoder.encode(tensors) if encoder is not None else pack_bucket(tensors)
        # the bucket holds what it needs (a staged file, or the object-store bucket's own views): the tensors are
        # not kept alive while the sender waits for the engines to take it
        tensors.clear()
        yield bucket
    if encoder is not None:
        encoder.finish(plan.sync_id)
