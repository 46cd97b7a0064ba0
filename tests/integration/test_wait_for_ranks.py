"""`wait_for_ranks`, how the trainer waits for a call on every actor rank: a rank that fails is raised at once, and
a call with a time limit (a checkpoint save, whose writer process may die and leave it waiting forever) ends with a
TimeoutError naming it."""

from __future__ import annotations

import time

import pytest

STUCK_S = 120.0  # a rank that never ends as far as the test is concerned: the waits must end long before it does


def test_a_call_past_its_time_limit_is_named_and_a_failure_is_raised_at_once(ray_local) -> None:
    ray = ray_local
    from rlsearch.actor.ranks import wait_for_ranks

    @ray.remote(num_cpus=0)
    def rank(seconds: float, fail: bool = False) -> float:
        time.sleep(seconds)
        if fail:
            raise ValueError("rank failed")
        return seconds

    def still_running(ref) -> bool:
        return not ray.wait([ref], timeout=0)[0]

    assert wait_for_ranks([rank.remote(0.1), rank.remote(0.2)], timeout_s=60) == [0.1, 0.2]
    stuck = rank.remote(STUCK_S)
    with pytest.raises(TimeoutError, match=r"^saving the checkpoint /x did not finish within 1 s$"):
        wait_for_ranks([rank.remote(0.1), stuck], timeout_s=1, what="saving the checkpoint /x")
    assert still_running(stuck)  # the wait ended at its limit, not when the rank did
    with pytest.raises(ray.exceptions.RayTaskError, match="rank failed"):
        wait_for_ranks([stuck, rank.remote(0.1, fail=True)])  # no limit: the failure ends the wait
    assert still_running(stuck)
    ray.cancel(stuck, force=True)
