"""`LoopThread.submit`: cancelling the future of a coroutine already running on the loop cancels the coroutine
(what `RolloutWorker.adopt` relies on to stop a dead driver's rollouts, whose requests vLLM then aborts)."""

from __future__ import annotations

import asyncio
import threading

from rlsearch.loop_thread import LoopThread


def test_cancelling_a_running_submission_cancels_its_coroutine_on_the_loop() -> None:
    events = LoopThread("test-loop")
    started, cancelled = threading.Event(), threading.Event()

    async def rollout() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    try:
        future = events.submit(rollout())
        assert started.wait(5)
        assert future.cancel()
        assert cancelled.wait(5)
        assert events.run(asyncio.sleep(0, result="still serving")) == "still serving"
    finally:
        events.stop()
