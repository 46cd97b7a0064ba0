"""The local Ray instance keeps no task events: its GCS does not grow with the actor calls of a long run (with Ray's
defaults it grew by 27 MiB over these 6,000 calls, up to ~370 MiB at its 100,000-task cap). Nor does it keep worker
processes that no actor uses (with Ray's defaults, one per core started with the instance: two here)."""

from __future__ import annotations

import time

import psutil

CALLS = 6000
GROWTH_LIMIT_MIB = 5.0


def _ray_process(name: str) -> psutil.Process:
    for process in psutil.Process().children(recursive=True):
        try:
            if process.name() == name:
                return process
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no {name} under this process: the session's Ray is not the local instance")


def _idle_workers(raylet: psutil.Process) -> list[int]:
    idle = []
    for process in raylet.children():
        try:
            if " ".join(process.cmdline()).startswith("ray::IDLE"):
                idle.append(process.pid)
        except psutil.NoSuchProcess:
            continue
    return idle


def test_thousands_of_actor_calls_do_not_grow_the_gcs(ray_local):
    ray = ray_local

    @ray.remote(num_cpus=0)
    class Echo:
        def ping(self, value: int) -> int:
            return value

    echo = Echo.remote()
    assert ray.get(echo.ping.remote(7)) == 7
    gcs = _ray_process("gcs_server")
    before = gcs.memory_info().rss
    for start in range(0, CALLS, 1000):
        assert ray.get([echo.ping.remote(value) for value in range(start, start + 1000)]) == list(
            range(start, start + 1000))
    time.sleep(2.0)  # past Ray's task-event report interval (1 s) had events been on
    grown_mib = (gcs.memory_info().rss - before) / 2**20
    ray.kill(echo)
    assert grown_mib < GROWTH_LIMIT_MIB, f"the GCS grew by {grown_mib:.1f} MiB over {CALLS} actor calls"


def test_no_worker_process_waits_idle(ray_local):
    """A worker starting for an actor is idle for a moment: none stays so (Ray's prestarted ones did, for good)."""
    raylet = _ray_process("raylet")
    deadline = time.monotonic() + 10
    while _idle_workers(raylet) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _idle_workers(raylet) == []
