"""The judge over two endpoints (reward.judge.endpoints): real HTTP judges on 127.0.0.1, the first killed mid-run."""

from __future__ import annotations

import re
import threading
import time

import uvicorn

from rlsearch.config import EndpointConfig, JudgeConfig, RewardConfig
from rlsearch.reward import RewardScorer
from tests.integration.judge_stub import Scripted, StubJudge, answered, row

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

        # both dead: every trajectory fails, counted, in bounded time (two rounds over two refused endpoints)
        second.kill()
        dead = [answered(f"<answer>town {i}</answer>", i) for i in range(4)]
        started = time.monotonic()
        stats = scorer.score(dead, [row()] * 4)
        assert time.monotonic() - started < 5.0
        assert stats["reward/judge_failures"] == 4 and all(t.failed.startswith("judge: 4 attempt(s) failed")
                                                           for t in dead)

        # the run goes on: the second judge back on its port scores the next step
        second.start()
        again = [answered(f"<answer>river {i}</answer>", i) for i in range(4)]
        stats = scorer.score(again, [row()] * 4)
        assert stats["reward/judge_failures"] == 0 and all(t.reward == 1.0 for t in again)
    finally:
        scorer.close()
        second.kill()
