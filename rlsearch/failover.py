"""Endpoints tried in order, with failover: the one policy the judge, the browse summariser and the web search adapters
share (each does its own I/O, sync or async, and asks this helper where to send the next attempt).

A call walks the endpoints in their configured order, those in cool-down last (the one whose cool-down ends first
before the others); a transient failure (a timeout, a refused connection, HTTP 429 or 5xx) puts the endpoint in
cool-down for ``cooldown_s`` and the call moves on to the next one at once (a failover). So a dead endpoint is skipped
while a live one answers, and tried again once its cool-down is over. When every endpoint failed in the first round,
the call backs off and starts another round, at most ``max_retries`` more; a retry round tries the endpoints that are
live again, or, when none is, the one whose cool-down ends first (one endpoint alone is retried exactly as before).
So every endpoint down costs at most one attempt per endpoint and one per retry, not a round of them per retry. A
success ends an endpoint's cool-down. A call may also have a deadline over all its attempts and waits: each attempt
gets what is left of it, and no backoff starts that would pass it. All endpoints down is an error after a bounded
number of attempts, never a hang, and a call never waits for an endpoint to come back.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

E = TypeVar("E")


@dataclass
class Attempt(Generic[E]):
    endpoint: E
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

    def call(self, max_retries: int, backoff_s: float, timeout_s: float = math.inf,
             deadline_s: float = 0.0) -> FailoverCall[E]:
        """One call's attempts (`FailoverCall`): ``max_retries`` retry rounds, the k-th after a backoff of
        ``backoff_s * 2**(k-1)``; each request within ``timeout_s``, all of them within ``deadline_s`` (0: none)."""
        return FailoverCall(self, max_retries, backoff_s, timeout_s, deadline_s)

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

    def _next(self, tried: set[int], first_round: bool) -> int | None:
        """The first endpoint not in cool-down and not tried this round; else, when the round has tried none yet or
        is the first, of those in cool-down and not tried, the one whose cool-down ends first; None when the round is
        over."""
        with self._lock:
            now = self._clock()
            untried = [index for index in range(len(self.endpoints)) if index not in tried]
            live = [index for index in untried if self._down_until[index] <= now]
            if live:
                return live[0]
            if first_round or not tried:
                return min(untried, key=self._down_until.__getitem__, default=None)
            return None

    def _index(self, endpoint: E) -> int:
        for index, candidate in enumerate(self.endpoints):
            if candidate is endpoint:
                return index
        return self.endpoints.index(endpoint)


class FailoverCall(Generic[E]):
    """Where one call's attempts go, one at a time: ``wait_s()`` is how long to wait before the next one (a retry
    round's backoff; 0 within a round), then ``next()`` picks its endpoint, once the caller is ready to send (after
    the wait, holding whatever slot it needs). The caller sends it within ``request_timeout_s()`` and reports
    `Failover.succeeded` (and stops) or `Failover.failed` (and asks again). ``wait_s()`` gives None when no attempt
    is left: the rounds are over, or the deadline passed or would pass during the backoff (``out_of_time``); the
    caller then counts `Failover.give_up`. ``next()`` gives None when the round ended during the wait (another request
    failed the endpoint ``wait_s()`` saw live) or the deadline passed: the caller asks ``wait_s()`` again, which
    starts the next round or says the call is over; a round ended so is not the call's end while retries are left."""

    def __init__(self, failover: Failover[E], max_retries: int, backoff_s: float, timeout_s: float,
                 deadline_s: float) -> None:
        self.failover = failover
        self.max_retries, self.backoff_s, self.timeout_s = max_retries, backoff_s, timeout_s
        self.deadline_s = deadline_s
        self.deadline = failover._clock() + deadline_s if deadline_s else math.inf
        self.sent = 0  # attempts handed out
        self.out_of_time = False
        self._round = 0
        self._tried: set[int] = set()
        self._previous: int | None = None

    def time_left_s(self) -> float:
        return self.deadline - self.failover._clock()

    def request_timeout_s(self) -> float:
        """The limit of the request about to be sent: the timeout, cut to what is left of the deadline."""
        return min(self.timeout_s, self.time_left_s())

    def wait_s(self) -> float | None:
        """Seconds to wait before the next attempt; None when there is none."""
        wait = 0.0
        if self._tried and self.failover._next(self._tried, self._round == 0) is None:  # the round is over
            if self._round == self.max_retries:
                return None
            self._round, self._tried = self._round + 1, set()
            wait = self.backoff_s * 2 ** (self._round - 1)
        if wait >= self.time_left_s():
            self.out_of_time = True
            return None
        return wait

    def next(self) -> Attempt[E] | None:
        """The next attempt, its endpoint picked now; None when the round ended or the deadline passed meanwhile (ask
        ``wait_s()`` again)."""
        if self.time_left_s() <= 0:
            self.out_of_time = True
            return None
        index = self.failover._next(self._tried, self._round == 0)
        if index is None:
            return None
        if self._previous is not None and index != self._previous:  # the previous endpoint failed: move on
            with self.failover._lock:
                self.failover.failovers += 1
        self._tried.add(index)
        self._previous = index
        self.sent += 1
        return Attempt(self.failover.endpoints[index], self.failover._clock())
