"""Concurrency checked by what happened, not by how long it took: `InFlight` counts the calls inside it at once."""

from __future__ import annotations

import asyncio
import threading
import time

# far above what any call in the tests needs to reach a meeting point, on the slowest CPU seen and a loaded one
HANG_GUARD_S = 30.0


class InFlight:
    """A context manager (``with`` in threads, ``async with`` on an event loop) around each call of a fake tool,
    server or engine: ``calls`` counts the calls that entered, ``most`` the most inside at once.

    With ``meet=n`` a call that enters waits there until n calls have been inside at once (from then on every call
    passes): only calls that run concurrently get through, and calls made one after the other end at the hang guard
    with a TimeoutError saying so (the first one; those after it at once), instead of depending on a machine's speed
    to be told apart."""

    def __init__(self, meet: int = 0, hang_guard_s: float = HANG_GUARD_S) -> None:
        self.meet, self.hang_guard_s = meet, hang_guard_s
        self.calls = self.now = self.most = 0
        self._lock = threading.Lock()
        self._met = threading.Event()
        self._broken = False  # the hang guard fired: no later call waits for it again
        if meet <= 1:
            self._met.set()

    def __enter__(self) -> InFlight:
        self._enter()
        if not self._met.wait(0 if self._broken else self.hang_guard_s):
            self._leave()
            raise self._hang()
        return self

    def __exit__(self, *_exc) -> None:
        self._leave()

    async def __aenter__(self) -> InFlight:
        self._enter()
        deadline = time.monotonic() + (0 if self._broken else self.hang_guard_s)
        while not self._met.is_set():  # polled: the calls may come from other threads' loops
            if time.monotonic() >= deadline:
                self._leave()
                raise self._hang()
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *_exc) -> None:
        self._leave()

    def _enter(self) -> None:
        with self._lock:
            self.calls += 1
            self.now += 1
            self.most = max(self.most, self.now)
            if self.now >= self.meet:
                self._met.set()

    def _leave(self) -> None:
        with self._lock:
            self.now -= 1

    def _hang(self) -> TimeoutError:
        self._broken = True
        return TimeoutError(f"hang guard: {self.hang_guard_s:g} s waiting for {self.meet} calls in flight at once, "
                            f"the most seen {self.most}")
