"""Seconds per phase of a weight sync, measured where each phase runs (an actor rank, an engine, the driver) and
summed up by the driver into `SyncStats.phases` (logged as weights/time/<phase>)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

Item = TypeVar("Item")

# what each phase covers, in the order a bucket meets them (the bench prints them in this order)
PHASES = {
    "export": "senders: gather TP (and EP) shards, convert to HF names and layouts",
    "pack": "senders: copy tensors into a bucket (flat, staged file or delta-encoded) and checksum it",
    "transfer": "senders: broadcast a bucket and wait for every engine to receive it (broadcast transport)",
    "stage": "engines: write a received bucket (a delta applied) to a shared-memory file (worst engine)",
    "load": "engines: verify and load staged buckets into the model (worst engine)",
    "finish": "engines: finalise the reload, reset the prefix cache, resume (worst engine)",
    "pause": "engines: from pausing the scheduler to resuming it (worst engine)",
}


class PhaseClock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

    def timed(self, name: str, items: Iterable[Item]) -> Iterator[Item]:
        """`items`, with the time spent producing each one counted as phase `name`."""
        iterator = iter(items)
        while True:
            with self.phase(name):
                try:
                    item = next(iterator)
                except StopIteration:
                    return
            yield item


def add_phases(total: dict[str, float], part: dict[str, float]) -> None:
    for name, seconds in part.items():
        total[name] = total.get(name, 0.0) + seconds


def worst_phases(parts: Iterable[dict[str, float]]) -> dict[str, float]:
    """Per phase, the largest seconds among `parts` (engines work side by side: the slowest one holds the sync)."""
    worst: dict[str, float] = {}
    for part in parts:
        for name, seconds in part.items():
            worst[name] = max(worst.get(name, 0.0), seconds)
    return worst
