"""The local Ray instance keeps no task events: its GCS does not grow with the actor calls of a long run (with Ray's
defaults it grew by 27 MiB over these 6,000 calls, up to ~370 MiB at its 100,000-task cap). Nor does it keep worker
processes that no actor can use (with Ray's defaults, one per core started with the instance: two here)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from tests.constants import REPO_ROOT

CALLS = 6000
GROWTH_LIMIT_MIB = 5.0


def _gcs_server() -> psutil.Process:
    for process in psutil.Process().children(recursive=True):
        try:
            if process.name() == "gcs_server":
                return process
        except psutil.NoSuchProcess:
            continue
    raise AssertionError("no gcs_server under this process: the session's Ray is not the local instance")


def test_thousands_of_actor_calls_do_not_grow_the_gcs(ray_local):
    ray = ray_local

    @ray.remote(num_cpus=0)
    class Echo:
        def ping(self, value: int) -> int:
            return value

    echo = Echo.remote()
    assert ray.get(echo.ping.remote(7)) == 7
    gcs = _gcs_server()
    before = gcs.memory_info().rss
    for start in range(0, CALLS, 1000):
        assert ray.get([echo.ping.remote(value) for value in range(start, start + 1000)]) == list(
            range(start, start + 1000))
    time.sleep(2.0)  # past Ray's task-event report interval (1 s) had events been on
    grown_mib = (gcs.memory_info().rss - before) / 2**20
    ray.kill(echo)
    assert grown_mib < GROWTH_LIMIT_MIB, f"the GCS grew by {grown_mib:.1f} MiB over {CALLS} actor calls"


IDLE_WORKERS_OF_A_NEW_INSTANCE = """
import time
import psutil
import ray
from rlsearch.ray_setup import init_ray
init_ray()
time.sleep(3)  # Ray's prestarted workers are up within a second of its start
raylet = next(p for p in psutil.Process().children(recursive=True) if p.name() == "raylet")
print(sum(' '.join(p.cmdline()).startswith('ray::IDLE') for p in raylet.children()))
ray.shutdown()
"""


def test_a_new_local_instance_starts_no_worker_that_waits_idle():
    """Prestarted workers (Ray's default: one per core) stay idle for the instance's life: a run's actors carry its
    runtime_env, which they lack. (Workers that ran tasks wait idle for the next task by design: a new instance.)"""
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    result = subprocess.run([sys.executable, "-c", IDLE_WORKERS_OF_A_NEW_INSTANCE], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-1] == "0", result.stdout
