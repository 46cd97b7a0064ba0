"""Seconds of the driver's blocks: `timed` adds a block's seconds to a dict, the step's time/* scalars and the
start-up phases alike. It calls nothing of rlsearch."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def timed(timings: dict[str, float], key: str) -> Iterator[None]:
    """Adds the seconds the block takes to timings[key]."""
    started = time.perf_counter()
    try:
        yield
    finally:
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - started
