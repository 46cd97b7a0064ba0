"""The shm transport (one node): each stage's sender streams buckets into Ray's object store; the driver hands every
bucket to every engine, whose host process stages it in a shared-memory file that all of its TP workers map."""

from __future__ import annotations

from collections.abc import Sequence

from .bucket import iter_buckets, pack_bucket
from .deadline import Deadline

# weight buckets a sender may have produced ahead of the engines: bounds its extra memory
BUCKETS_IN_FLIGHT = 2


def send_stage(stage_workers: Sequence, engines: Sequence, bucket_bytes: int, deadline: Deadline) -> dict[str, int]:
    """Every bucket of one pipeline stage into every engine. ``stage_workers``: the stage's DP-rank-0 ranks, its
    sender (TP rank 0) first; each runs `stream_buckets`. Returns the stage's buckets, tensors and payload bytes."""
    streams = [
        worker.export_weight_buckets.options(
            num_returns="streaming", _generator_backpressure_num_objects=BUCKETS_IN_FLIGHT
        ).remote(bucket_bytes)
        for worker in stage_workers
    ]
    sent = {"buckets": 0, "tensors": 0, "bytes": 0}
    while True:
        deadline.wait([streams[0]], "the actor stage's sender to export its next weight bucket")
        try:
            bucket_ref = next(streams[0])
        except StopIteration:
            break
        loads = [engine.weight_rpc.remote("load_bucket", bucket_ref) for engine in engines]
        tensors, nbytes = deadline.get(loads, "loading a weight bucket", engines)[0]
        sent["buckets"] += 1
        sent["tensors"] += tensors
        sent["bytes"] += nbytes
    for stream in streams[1:]:  # the TP peers yield nothing; their end says they finished cleanly
        deadline.wait([stream], "the actor stage's TP peers to finish the export")
        for _ in stream:
            pass
    return sent


def stream_buckets(named_tensors, bucket_bytes: int, is_sender: bool):
    """The actor rank's side: buckets of its stage's HF tensors (the sender yields them, TP peers only take part)."""
    if is_sender:
        for tensors in iter_buckets(named_tensors, bucket_bytes):
            yield pack_bucket(tensors)
    else:
        for _ in named_tensors:
            pass
