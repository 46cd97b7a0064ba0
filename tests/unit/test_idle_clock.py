"""The rollout worker's idle clock: time with no rollout in flight, with overlapping rollouts on several threads."""

import pytest

from rlsearch.rollout import worker


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(worker.time, "perf_counter", lambda: now[0])
    return now


def test_idle_clock_counts_only_time_with_no_rollout_in_flight(clock):
    idle = worker.IdleClock()
    clock[0] += 2.0  # idle since start-up
    first = idle.busy()
    first.__enter__()
    clock[0] += 3.0
    second = idle.busy()  # overlaps the first
    second.__enter__()
    clock[0] += 1.0
    first.__exit__(None, None, None)
    clock[0] += 4.0  # the second still runs
    assert idle.take() == 2.0
    second.__exit__(None, None, None)
    clock[0] += 0.5
    assert idle.take() == 0.5  # idle until now, counted once
    clock[0] += 1.5
    with idle.busy():
        clock[0] += 7.0
    assert idle.take() == 1.5


def test_idle_clock_recovers_after_a_failed_rollout(clock):
    idle = worker.IdleClock()
    with pytest.raises(RuntimeError), idle.busy():
        raise RuntimeError("engine died")
    clock[0] += 1.0
    assert idle.take() == 1.0
