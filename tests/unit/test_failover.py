"""The endpoint failover policy the judge, the browse summariser and the web search adapters share."""

from __future__ import annotations

from rlsearch.failover import Failover


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def walk(failover: Failover, outcome, max_retries: int = 1, backoff_s: float = 1.0) -> list[tuple[str, float]]:
    """The (endpoint, wait) of a call's attempts; ``outcome(endpoint)`` says whether that attempt succeeds."""
    sent = []
    for attempt in failover.attempts(max_retries, backoff_s):
        sent.append((attempt.endpoint, attempt.wait_s))
        if outcome(attempt.endpoint):
            failover.succeeded(attempt.endpoint)
            return sent
        failover.failed(attempt.endpoint)
    failover.give_up()
    return sent


def test_a_dead_endpoint_is_failed_over_then_skipped_until_its_cooldown_ends() -> None:
    clock = Clock()
    failover = Failover(["a", "b", "c"], cooldown_s=30.0, clock=clock)
    assert walk(failover, lambda e: e == "b") == [("a", 0.0), ("b", 0.0)]
    assert failover.failovers == 1 and failover.is_down("a") and not failover.is_down("b")
    assert walk(failover, lambda e: e == "b") == [("b", 0.0)]  # a is skipped: no attempt, no failover
    assert failover.failovers == 1
    clock.now += 30.0  # the cool-down is over: a is tried first again
    assert walk(failover, lambda e: True) == [("a", 0.0)]
    assert not failover.is_down("a")


def test_all_dead_makes_bounded_rounds_with_backoff_and_counts_the_call() -> None:
    failover = Failover(["a", "b"], cooldown_s=30.0, clock=Clock())
    sent = walk(failover, lambda e: False, max_retries=2, backoff_s=0.5)
    # round 1 tries both; each retry round starts after its backoff at the endpoint whose cool-down ends first
    assert sent == [("a", 0.0), ("b", 0.0), ("a", 0.5), ("b", 0.0), ("a", 1.0), ("b", 0.0)]
    assert failover.exhausted == 1 and failover.failovers == 5
    # every endpoint in cool-down: a new call still tries (the soonest back), it never waits for one to recover
    assert walk(failover, lambda e: e == "b", max_retries=0) == [("a", 0.0), ("b", 0.0)]


def test_one_endpoint_is_retried_as_plain_retries() -> None:
    failover = Failover(["only"], cooldown_s=30.0, clock=Clock())
    outcomes = iter([False, False, True])
    assert walk(failover, lambda e: next(outcomes), max_retries=3, backoff_s=1.0) == [
        ("only", 0.0), ("only", 1.0), ("only", 2.0)]
    assert failover.failovers == 0 and failover.exhausted == 0


def test_an_answer_to_a_request_sent_before_the_endpoint_failed_keeps_its_cooldown() -> None:
    """A judge killed mid-run still answers the request it was serving; the requests after it must not go back."""
    clock = Clock()
    failover = Failover(["a", "b"], cooldown_s=30.0, clock=clock)
    in_flight = next(failover.attempts(0, 0.0))
    clock.now += 1.0
    failing = next(failover.attempts(0, 0.0))
    assert in_flight.endpoint == failing.endpoint == "a"
    clock.now += 1.0
    failover.failed(failing.endpoint)
    clock.now += 1.0
    failover.succeeded(in_flight.endpoint, in_flight.issued_at)
    assert failover.is_down("a")
    assert next(failover.attempts(0, 0.0)).endpoint == "b"
    failover.succeeded("a", issued_at=clock.now)  # sent after the failure: its answer ends the cool-down
    assert not failover.is_down("a")
