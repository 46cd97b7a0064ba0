"""An asyncio event loop on a daemon thread: synchronous code runs coroutines on it and blocks for the result."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """Owns one event loop for the lifetime of an object whose async resources (clients, engines) are bound to it."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the loop; blocks the calling thread until it is done (its exception is raised here)."""
        return self.submit(coroutine).result()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        """Run ``coroutine`` on the loop; its future, whose ``cancel()`` cancels the coroutine there."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
