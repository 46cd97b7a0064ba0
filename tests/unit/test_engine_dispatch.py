"""The group scheduler of EnginePool (`dispatch_groups`) over stand-in engines with controllable delays and deaths:
it tests the scheduling, not vLLM (tests/integration/test_engines.py runs real engines)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from rlsearch.rollout import NoEngineLeftError, PromptItem, Trajectory, dispatch_groups
from tests.concurrency import HANG_GUARD_S


class FakeEngine:
    """Sleeps `delay_s` per generate call, after `held_until()` is true when given (polled; a call still held after
    the hang guard raises TimeoutError saying so); from call `dies_at` on (1-based) it raises Ray's ActorDiedError."""

    def __init__(self, delay_s: float, dies_at: int = 0, held_until: Callable[[], bool] | None = None,
                 unreachable_calls: tuple[int, ...] = ()) -> None:
        self.delay_s, self.dies_at, self.held_until = delay_s, dies_at, held_until
        self.unreachable_calls = unreachable_calls  # calls (1-based) that fail as Ray's ActorUnavailableError
        self.calls: list[list[int]] = []  # group ids of each call
        self.finished = 0  # calls that returned or raised
        self.lock = threading.Lock()

    def generate(self, items: list[PromptItem], step: int) -> list[Trajectory]:
        with self.lock:
            self.calls.append(sorted({item.group_id for item in items}))
            call = len(self.calls)
        try:
            self._hold()
            time.sleep(self.delay_s)
        finally:
            with self.lock:
                self.finished += 1
        if self.dies_at and call >= self.dies_at:
            raise ActorDiedError()
        if call in self.unreachable_calls:
            raise ActorUnavailableError("the connection to the actor dropped", None)
        return [Trajectory(item.example_id, item.group_id, item.sample_index, [step]) for item in items]

    def _hold(self) -> None:
        deadline = time.monotonic() + HANG_GUARD_S
        while self.held_until is not None and not self.held_until():
            if time.monotonic() > deadline:
                raise TimeoutError(f"hang guard: a call held {HANG_GUARD_S:g} s, never released")
            time.sleep(0.01)


def _items(groups: int, group_size: int = 3) -> list[PromptItem]:
    # samples interleaved across groups: the scheduler must gather each group's items itself
    return [PromptItem(f"q{g}", "question", group_id=g, sample_index=s)
            for s in range(group_size) for g in range(groups)]


def _run(engines: list[FakeEngine], items: list[PromptItem], groups_per_engine: int, timeout_s: float = 30.0):
    with ThreadPoolExecutor(max_workers=64) as threads:
        return dispatch_groups(
            items, list(range(len(engines))),
            lambda engine, group: threads.submit(engines[engine].generate, group, 7), groups_per_engine, timeout_s,
        )


def test_groups_stay_whole_and_come_back_in_item_order():
    engines = [FakeEngine(0.01), FakeEngine(0.01)]
    items = _items(groups=6)
    result = _run(engines, items, groups_per_engine=1)
    wanted = [(item.example_id, item.sample_index) for item in items]
    assert [(t.example_id, t.sample_index) for t in result.trajectories] == wanted
    calls = [group for engine in engines for group in engine.calls]
    assert sorted(calls) == [[g] for g in range(6)]  # one call per group, each group exactly once
    for g in range(6):
        ran_on = {t.engine for t in result.trajectories if t.group_id == g}
        assert len(ran_on) == 1 and ran_on <= {0, 1}
    assert result.groups[0] + result.groups[1] == 6 and result.redispatched == 0 and result.died == []


def test_spread_deals_every_group_round_robin_at_once():
    engines = [FakeEngine(0.05), FakeEngine(0.05)]
    result = _run(engines, _items(groups=5), groups_per_engine=0)
    assert engines[0].calls == [[0], [2], [4]] and engines[1].calls == [[1], [3]]
    assert result.groups == {0: 3, 1: 2}


def test_a_slow_engine_does_not_hold_the_fast_one_idle():
    # the slow engine's first group is held until the fast engine has started every other group: dealt in step with
    # the slow engine, the fast one would get no second group and the slow one's call would end at its hang guard
    groups = 16
    fast = FakeEngine(0.02)
    slow = FakeEngine(0.0, held_until=lambda: len(fast.calls) == groups - 1)
    result = _run([slow, fast], _items(groups=groups), groups_per_engine=1, timeout_s=2 * HANG_GUARD_S)
    assert slow.calls == [[0]] and fast.calls[0] == [1]  # the deterministic first deal
    assert sorted(fast.calls) == [[g] for g in range(1, groups)]
    assert result.groups == {0: 1, 1: groups - 1}
    assert result.busy_s[1] >= result.groups[1] * fast.delay_s  # busy_s counts each call in flight


def test_a_dying_engine_hands_its_groups_to_the_survivor():
    dying, healthy = FakeEngine(0.05, dies_at=2), FakeEngine(0.05)
    items = _items(groups=8)
    result = _run([dying, healthy], items, groups_per_engine=2)
    assert result.died == [0]
    failed = [group for group in dying.calls[1:]]  # every call from the 2nd on raised
    assert result.redispatched == len(failed) >= 1
    assert all(t is not None for t in result.trajectories)
    for (group,) in failed:
        assert {t.engine for t in result.trajectories if t.group_id == group} == {1}
        assert [group] in healthy.calls
    assert result.groups[0] == 1 and result.groups[1] == 7


def test_an_engine_unreachable_for_a_moment_gets_its_group_again_and_stays():
    flaky, healthy = FakeEngine(0.02, unreachable_calls=(1, 2)), FakeEngine(0.05)
    result = _run([flaky, healthy], _items(groups=6), groups_per_engine=1)
    assert result.died == [] and result.unavailable == 2 and result.redispatched == 2
    assert all(t is not None for t in result.trajectories)
    assert result.groups[0] >= 1 and result.groups[0] + result.groups[1] == 6  # it went on running groups


def test_an_engine_unreachable_call_after_call_is_dead():
    gone, healthy = FakeEngine(0.01, unreachable_calls=tuple(range(1, 100))), FakeEngine(0.05)
    result = _run([gone, healthy], _items(groups=6), groups_per_engine=1)
    assert result.died == [0] and result.unavailable == 3  # UNAVAILABLE_RETRIES, then the 4th call's error is death
    assert len(gone.calls) == 4 and result.groups == {0: 0, 1: 6}


def test_no_engine_left_is_a_clear_error():
    with pytest.raises(NoEngineLeftError, match="every rollout engine died"):
        _run([FakeEngine(0.01, dies_at=1), FakeEngine(0.01, dies_at=1)], _items(groups=3), groups_per_engine=1)


def test_a_stuck_engine_times_out_instead_of_hanging():
    released = threading.Event()
    stuck = FakeEngine(0.0, held_until=released.is_set)
    with ThreadPoolExecutor(max_workers=1) as threads:
        try:
            with pytest.raises(TimeoutError, match="no rollout group finished within"):
                dispatch_groups(_items(groups=1), [0], lambda engine, group: threads.submit(stuck.generate, group, 7),
                                groups_per_engine=1, timeout_s=0.3)
            assert (len(stuck.calls), stuck.finished) == (1, 0)  # it gave up with the call still running
        finally:
            released.set()
