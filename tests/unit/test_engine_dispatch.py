"""The group scheduler of EnginePool (`dispatch_groups`) over stand-in engines with controllable delays and deaths:
it tests the scheduling, not vLLM (tests/integration/test_engines.py runs real engines)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from ray.exceptions import ActorDiedError

from rlsearch.rollout import NoEngineLeftError, PromptItem, Trajectory, dispatch_groups


class FakeEngine:
    """Sleeps `delay_s` per generate call; from call `dies_at` on (1-based) it raises Ray's ActorDiedError."""

    def __init__(self, delay_s: float, dies_at: int = 0) -> None:
        self.delay_s, self.dies_at = delay_s, dies_at
        self.calls: list[list[int]] = []  # group ids of each call
        self.spans: list[tuple[float, float]] = []  # (start, end) of each finished call, perf_counter seconds
        self.lock = threading.Lock()

    def generate(self, items: list[PromptItem], step: int) -> list[Trajectory]:
        started = time.perf_counter()
        with self.lock:
            self.calls.append(sorted({item.group_id for item in items}))
            call = len(self.calls)
        time.sleep(self.delay_s)
        with self.lock:
            self.spans.append((started, time.perf_counter()))
        if self.dies_at and call >= self.dies_at:
            raise ActorDiedError()
        return [Trajectory(item.example_id, item.group_id, item.sample_index, [step]) for item in items]


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
    slow, fast = FakeEngine(0.4), FakeEngine(0.02)
    result = _run([slow, fast], _items(groups=16), groups_per_engine=1)
    assert slow.calls[0] == [0] and fast.calls[0] == [1]  # the deterministic first deal
    assert result.groups[1] >= 3 * result.groups[0], result.groups
    assert result.groups[0] + result.groups[1] == 16
    # the fast engine got its next group as soon as it finished one, not when the slow one finished (a deal in step
    # with the slow engine would leave it ~0.4 s idle between calls). Not its busy share of the wall: the slow engine's
    # last group sets the wall, and on a loaded machine that share fell to 0.46 with nothing wrong.
    gaps = [start - end for (_, end), (start, _) in zip(fast.spans, fast.spans[1:])]
    assert max(gaps) < slow.delay_s / 2, gaps
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


def test_no_engine_left_is_a_clear_error():
    with pytest.raises(NoEngineLeftError, match="every rollout engine died"):
        _run([FakeEngine(0.01, dies_at=1), FakeEngine(0.01, dies_at=1)], _items(groups=3), groups_per_engine=1)


def test_a_stuck_engine_times_out_instead_of_hanging():
    started = time.perf_counter()
    with pytest.raises(TimeoutError, match="no rollout group finished within"):
        _run([FakeEngine(3.0)], _items(groups=1), groups_per_engine=1, timeout_s=0.3)
    assert time.perf_counter() - started < 5.0
