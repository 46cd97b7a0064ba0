"""The endpoint failover policy the judge, the browse summariser and the web search adapters share."""

from __future__ import annotations

from rlsearch.failover import Failover


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def walk(failover: Failover, outcome, max_retries: int = 1, backoff_s: float = 1.0,
         clock: Clock | None = None) -> list[tuple[str, float]]:
    """The (endpoint, wait) of a call's attempts; ``outcome(endpoint)`` says whether that attempt succeeds. With
    ``clock``, each attempt takes a second of it."""
    sent = []
    call = failover.call(max_retries, backoff_s)
    while (wait := call.wait_s()) is not None:
        attempt = call.next()
        sent.append((attempt.endpoint, wait))
        if clock is not None:
            clock.now += 1.0
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
    clock = Clock()
    failover = Failover(["a", "b"], cooldown_s=30.0, clock=clock)
    sent = walk(failover, lambda e: False, max_retries=2, backoff_s=0.5, clock=clock)
    # round 1 tries both; each retry round, after its backoff, the endpoint whose cool-down ends first, and no other
    # that is still cooling down: one attempt per endpoint and one per retry, not a round of them per retry
    assert sent == [("a", 0.0), ("b", 0.0), ("a", 0.5), ("b", 1.0)]
    assert failover.exhausted == 1 and failover.failovers == 3
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
    in_flight = failover.call(0, 0.0).next()
    clock.now += 1.0
    failing = failover.call(0, 0.0).next()
    assert in_flight.endpoint == failing.endpoint == "a"
    clock.now += 1.0
    failover.failed(failing.endpoint)
    clock.now += 1.0
    failover.succeeded(in_flight.endpoint, in_flight.issued_at)
    assert failover.is_down("a")
    assert failover.call(0, 0.0).next().endpoint == "b"
    failover.succeeded("a", issued_at=clock.now)  # sent after the failure: its answer ends the cool-down
    assert not failover.is_down("a")


def test_a_deadline_bounds_the_call_its_requests_get_what_is_left_and_no_backoff_passes_it() -> None:
    clock = Clock()
    failover = Failover(["a", "b"], cooldown_s=30.0, clock=clock)
    call = failover.call(max_retries=5, backoff_s=1.0, timeout_s=10.0, deadline_s=25.0)
    timeouts = []
    while (wait := call.wait_s()) is not None:
        clock.now += wait
        attempt = call.next()
        timeouts.append(call.request_timeout_s())
        clock.now += timeouts[-1]  # every request times out
        failover.failed(attempt.endpoint)
    # a and b at 10 s each, the retry after 1 s gets the 4 s left; the next backoff (2 s) would pass the deadline
    assert timeouts == [10.0, 10.0, 4.0] and call.sent == 3 and call.out_of_time


def test_an_endpoint_failed_by_another_request_during_the_wait_starts_the_next_round_not_the_end(monkeypatch) -> None:
    """Between ``wait_s()`` and ``next()`` another request fails the endpoint the wait was for: the round is over,
    but the call has a retry round left and must use it (the HTTP tools and the judge gave up there)."""
    import httpx

    from rlsearch.tools import http

    clock = Clock()
    failover = Failover(["a", "b"], cooldown_s=1.0, clock=clock)
    sent: list[str] = []
    answers = {"a": iter([503, 503, 200]), "b": iter([503])}

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.host)
        return httpx.Response(next(answers[request.url.host]))

    def sleep(wait: float) -> None:
        clock.now += wait
        if wait == 0 and sent == ["a", "b", "a"]:  # round 1 found b live again; another request fails it before next()
            failover.failed("b")

    monkeypatch.setattr(http.time, "sleep", sleep)
    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        response = http.send_with_failover(client, lambda endpoint: client.build_request("GET", f"http://{endpoint}/"),
                                           failover, "the search", max_retries=2, backoff_s=1.0, timeout_s=10.0)
    assert response.status_code == 200
    assert sent == ["a", "b", "a", "a"]  # the last after round 2's backoff
