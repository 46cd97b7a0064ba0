"""Move the actor's weights into the rollout engines after each step, then verify them on a probe."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import ray


@dataclass
class SyncStats:
    seconds: float
    num_buckets: int
    num_tensors: int
    num_bytes: int  # bucket bytes received by each engine


def sync_weights(actor_group, engines: Sequence, bucket_mb: float) -> SyncStats:
    """Stream HF-named weight buckets from the actor group into every engine (one reload session each)."""
    started = time.perf_counter()
    ray.get([engine.begin_weight_update.remote() for engine in engines])
    num_buckets = num_tensors = num_bytes = 0
    for bucket_ref in actor_group.export_weight_buckets(int(bucket_mb * 1024 * 1024)):
        tensors, nbytes = ray.get([engine.load_weight_bucket.remote(bucket_ref) for engine in engines])[0]
        num_buckets += 1
        num_tensors += tensors
        num_bytes += nbytes
    ray.get([engine.finish_weight_update.remote() for engine in engines])
    return SyncStats(time.perf_counter() - started, num_buckets, num_tensors, num_bytes)


def logprob_mismatch(engine_logprobs: Sequence[float], actor_logprobs: Sequence[float]) -> tuple[float, float]:
    """(max, mean) absolute difference between two per-token logprob lists of the same sequence; both NaN when any
    logprob is NaN or infinite (so a `mismatch < limit` check fails, and `max` cannot skip a NaN)."""
    if len(engine_logprobs) != len(actor_logprobs) or not engine_logprobs:
        raise ValueError(f"cannot compare {len(engine_logprobs)} engine and {len(actor_logprobs)} actor logprobs")
    if nonfinite_logprobs(engine_logprobs, actor_logprobs):
        return math.nan, math.nan
    diffs = [abs(a - b) for a, b in zip(engine_logprobs, actor_logprobs)]
    return max(diffs), sum(diffs) / len(diffs)


def nonfinite_logprobs(engine_logprobs: Sequence[float], actor_logprobs: Sequence[float]) -> str:
    """Which side has NaN/inf logprobs and at how many positions, e.g. 'actor: 11 of 11 positions NaN/inf';
    empty when all are finite."""
    parts = []
    for side, values in (("engine", engine_logprobs), ("actor", actor_logprobs)):
        bad = [index for index, value in enumerate(values) if not math.isfinite(value)]
        if bad:
            parts.append(f"{side}: {len(bad)} of {len(values)} positions NaN/inf (first at position {bad[0]}: "
                         f"{values[bad[0]]})")
    return "; ".join(parts)
