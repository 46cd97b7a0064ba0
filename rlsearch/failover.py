"""Endpoints tried in order, with failover: the one policy the judge, the browse summariser and the web search adapters
share (each does its own I/O, sync or async, and asks this helper where to send the next attempt).

A call walks the endpoints in their configured order, those in cool-down last (the one whose cool-down ends first
before the others); a transient failure (a timeout, a refused connection, HTTP 429 or 5xx) puts the endpoint in
cool-down for ``cooldown_s`` and the call moves on to the next one at once (a failover). So a dead endpoint is skipped
while a live one answers, and tried again once its cool-down is over. When every endpoint failed in a round, the call
backs off and starts another round, at most ``max_retries`` more (one endpoint alone is retried exactly as before). A
success ends an endpoint's cool-down. All endpoints down is an error after a bounded number of attempts, never a hang,
and a call never waits for an endpoint to come back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

E = TypeVar("E")


@dataclass
class Attempt(Generic[E]):
    endpoint: E
    wait_s: float  # to wait before sending it (a retry round's backoff)
    issued_at: float  # the failover's clock when the attempt was handed out


class Failover(Generic[E]):
    """The endpoints of one service and their cool-downs. Thread-safe; counters: ``failovers`` (a call moved on
    from a failed endpoint to another), ``exhausted`` (calls whose every attempt failed)."""

    def __init__(self, endpoints: Sequence[E], cooldown_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not endpoints:
            raise ValueError("a failover list needs at least one endpoint")
        self.endpoints = list(endpoints)
        self.cooldown_s = cooldown_s
        self.failovers = 0
        self.exhausted = 0
        self._clock = clock
        self._down_until = [0.0] * len(self.endpoints)
        self._lock = threading.Lock()

    def attempts(self, max_retries: int, backoff_s: float) -> Iterator[Attempt[E]]:
        """Where a call's attempts go, one at a time: the caller sends each, then reports `succeeded` (and stops) or
        `failed` (and takes the next). Ends after ``max_retries`` + 1 rounds; the caller then counts `give_up`."""
        previous: int | None = None
        for round_index in range(max_retries + 1):
            tried: set[int] = set()
            while True:
                index = self._next(tried)
                if index is None:
                    break
                if previous is not None and index != previous:  # the previous endpoint failed: move on
                    with self._lock:
                        self.failovers += 1
                wait = backoff_s * 2 ** (round_index - 1) if round_index and not tried else 0.0
                tried.add(index)
                previous = index
                yield Attempt(self.endpoints[index], wait, self._clock())

    def succeeded(self, endpoint: E, issued_at: float = float("inf")) -> None:
        """An answer ends the endpoint's cool-down, unless it failed after the answered attempt was issued (a request
        in flight when the endpoint died can still be answered; the requests after it would not be)."""
        with self._lock:
            index = self._index(endpoint)
            if self._down_until[index] - self.cooldown_s <= issued_at:  # the last failure's time
                self._down_until[index] = 0.0

    def failed(self, endpoint: E) -> None:
        """A transient failure: the endpoint is skipped for ``cooldown_s``."""
        with self._lock:
            self._down_until[self._index(endpoint)] = self._clock() + self.cooldown_s

    def give_up(self) -> None:
        with self._lock:
            self.exhausted += 1

    def is_down(self, endpoint: E) -> bool:
        with self._lock:
            return self._down_until[self._index(endpoint)] > self._clock()

    def _next(self, tried: set[int]) -> int | None:
        """The first endpoint not in cool-down and not tried this round; else, of those in cool-down and not tried,
        the one whose cool-down ends first; None when the round tried them all."""
        with self._lock:
            now = self._clock()
            untried = [index for index in range(len(self.endpoints)) if index not in tried]
            live = [index for index in untried if self._down_until[index] <= now]
            if live:
                return live[0]
            return min(untried, key=self._down_until.__getitem__, default=None)

    def _index(self, endpoint: E) -> int:
        for index, candidate in enumerate(self.endpoints):
            if candidate is endpoint:
                return index
        return self.endpoints.index(endpoint)
