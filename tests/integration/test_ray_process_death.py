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


def test_an_actor_that_rays_memory_monitor_killed_counts_as_dead(ray_local):
    """Ray answers a call to an actor its memory monitor killed with OutOfMemoryError, which is no actor error:
    actor_states counts it as dead, so that the trainer names the actor instead of raising Ray's error (a ping
    stands in for each actor here: a task that raises as the killed one's call does, and one that answers)."""
    from types import SimpleNamespace

    from rlsearch.ray_setup import actor_states

    ray = ray_local

    @ray.remote(num_cpus=0)
    def killed_for_memory() -> None:
        raise ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory.")

    @ray.remote(num_cpus=0)
    def answers() -> None:
        return None

    killed = SimpleNamespace(__ray_ready__=SimpleNamespace(remote=killed_for_memory.remote))
    live = SimpleNamespace(__ray_ready__=SimpleNamespace(remote=answers.remote))
    assert actor_states([killed, live], timeout_s=60) == ["dead", "live"]
