"""A Ray actor killed by a signal in the middle of a call (as the kernel's OOM killer or Ray's memory monitor kill a
rank) raised nothing of its own: the failure the terminal shows names it by its pid and says how Ray saw it die."""

from __future__ import annotations

import os
import signal
import time

import pytest


def test_a_killed_actor_is_named_with_rays_account_of_its_death(ray_local, tmp_path):
    from rlsearch.runlog import process_failure

    ray = ray_local

    @ray.remote(num_cpus=0)
    class Sleeper:
        def pid(self) -> int:
            return os.getpid()

        def sleep(self) -> None:
            time.sleep(60)

    sleeper = Sleeper.remote()
    pid = ray.get(sleeper.pid.remote())
    call = sleeper.sleep.remote()
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ray.exceptions.ActorDiedError) as raised:
        ray.get(call, timeout=60)
    failure = process_failure(raised.value, tmp_path)
    assert failure.process == f"the process {pid}"
    assert failure.errors == ()
    assert failure.death.startswith("SYSTEM_ERROR: Worker unexpectedly exits"), failure.death
    assert "killed by the OOM killer" in failure.death
    assert failure.render("train").startswith(
        f"rlsearch train: the process {pid} failed: it died without an error line of its own; Ray: SYSTEM_ERROR: ")
