"""The judge over two endpoints (reward.judge.endpoints): real HTTP judges on 127.0.0.1, the first killed mid-run."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import pytest
import uvicorn

from rlsearch.config import EndpointConfig, JudgeConfig, RewardConfig
from rlsearch.reward import RewardScorer
from rlsearch.reward.judge import Judge, JudgeCounters, JudgeError
from tests.integration.judge_stub import Scripted, StubJudge, answered, row, stub_judge, trickling_chat_server

_ANSWER = re.compile(r"Agent's answer: (.*)")


class LiveJudge:
    """A stub judge served on a loopback port in a thread; ``kill()`` stops it (its port then refuses connections),
    ``start()`` serves it again on the same port."""

    def __init__(self, stub: StubJudge, port: int = 0) -> None:
        self.stub, self.port = stub, port
        self.server: uvicorn.Server | None = None

    def start(self) -> LiveJudge:
        self.server = uvicorn.Server(uvicorn.Config(self.stub.app(), host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the stub judge did not start"
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def kill(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _correct(prompt: str, attempt: int) -> Scripted:
    return Scripted("Verdict: correct", delay_s=0.05)


def test_judge_fails_over_to_the_second_endpoint_when_the_first_is_killed_mid_run(tmp_path) -> None:
    second = LiveJudge(StubJudge(_correct)).start()
    first_answers: list[str] = []

    def first_script(prompt: str, attempt: int) -> Scripted:
        first_answers.append(prompt)
        if len(first_answers) == 4:  # killed after its fourth answer, with the step's other requests still to come
            threading.Thread(target=first.kill).start()
        return Scripted("Verdict: correct", delay_s=0.05)

    first = LiveJudge(StubJudge(first_script)).start()
    judge = JudgeConfig(endpoints=[EndpointConfig(first.url, "judge-a"), EndpointConfig(second.url, "judge-b")],
                        max_concurrency=2, timeout_s=2.0, max_retries=1, backoff_s=0.05, cooldown_s=60.0,
                        cache_dir=str(tmp_path / "judge_cache"))
    scorer = RewardScorer(RewardConfig(scorers={"judged": "judge"}, judge=judge))
    try:
        trajectories = [answered(f"<answer>city {i}</answer>", i) for i in range(16)]
        stats = scorer.score(trajectories, [row()] * 16)
        # every trajectory scored, the first judge's answers before it died and the second's after
        assert not any(t.failed for t in trajectories) and all(t.reward == 1.0 for t in trajectories)
        assert len(first.stub.prompts) >= 4 and len(first.stub.prompts) + len(second.stub.prompts) == 16
        # a failover per request in flight when it died at most; later requests skip it (cool-down)
        assert 1 <= stats["reward/judge_failovers"] <= 2 and stats["reward/judge_failures"] == 0

        # both dead: every trajectory fails, counted, after 3 attempts each (a round over both refused endpoints,
        # then the retry round's one attempt at the endpoint back first: not a round of them per retry)
        second.kill()
        dead = [answered(f"<answer>town {i}</answer>", i) for i in range(4)]
        stats = scorer.score(dead, [row()] * 4)
        assert stats["reward/judge_failures"] == 4 and all(t.failed.startswith("judge: 3 attempt(s) failed")
                                                           for t in dead)

        # the run goes on: the second judge back on its port scores the next step
        second.start()
        again = [answered(f"<answer>river {i}</answer>", i) for i in range(4)]
        stats = scorer.score(again, [row()] * 4)
        assert stats["reward/judge_failures"] == 0 and all(t.reward == 1.0 for t in again)
    finally:
        scorer.close()
        second.kill()


HANG_GUARD_S = 30.0  # far above what any call here needs: a call still running then is a hang


def test_a_judge_that_trickles_bytes_is_cut_off_per_request_and_by_the_calls_deadline() -> None:
    """A judge answering 200 and then a space every 0.2 s forever: each request is held to timeout_s as a whole
    (openai's timeout bounds each read), the call to deadline_s: 1 s, a 0.5 s backoff, 1 s, and the next backoff
    (1 s) would pass the 3 s deadline."""
    async def ask(url: str) -> None:
        judge = Judge(JudgeConfig(base_url=url, model="m", timeout_s=1.0, max_retries=5, backoff_s=0.5,
                                  deadline_s=3.0, cache_dir=""))
        try:
            await asyncio.wait_for(judge.reply("is Paris the capital?", JudgeCounters()), HANG_GUARD_S)
        finally:
            await judge.close()

    with trickling_chat_server() as (trickler, url), pytest.raises(JudgeError) as raised:
        asyncio.run(ask(url))
    assert str(raised.value) == ("2 attempt(s) failed within reward.judge.deadline_s (3 s), the last: timed out "
                                 "after 1 s")
    assert trickler.requests == 2 and trickler.bytes_sent >= 2


def test_a_judge_call_backing_off_gives_its_concurrency_slot_to_the_next_request() -> None:
    """One slot (max_concurrency 1): the first prompt's 500 sends it into a 2 s backoff, and the prompt asked
    meanwhile is sent during that backoff, not after the retry."""
    def script(prompt: str, attempt: int) -> Scripted:
        return Scripted("Verdict: correct", status=500 if prompt == "first" and attempt == 1 else 200)

    async def ask_two(url: str) -> list[str]:
        judge = Judge(JudgeConfig(base_url=url, model="m", max_concurrency=1, backoff_s=2.0, cooldown_s=60.0,
                                  cache_dir=""))
        counters = JudgeCounters()
        try:
            first = asyncio.create_task(judge.reply("first", counters))
            async with asyncio.timeout(HANG_GUARD_S):
                while not judge.endpoints.is_down(judge.endpoints.endpoints[0]):  # its first attempt failed
                    await asyncio.sleep(0.01)
                return [await judge.reply("second", counters), await first]
        finally:
            await judge.close()

    with stub_judge(script) as (stub, url):
        assert asyncio.run(ask_two(url)) == ["Verdict: correct"] * 2
    assert stub.prompts == ["first", "second", "first"]
