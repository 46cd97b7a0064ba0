"""The judge scorer against a real HTTP judge on 127.0.0.1 (scripted replies, delays, HTTP errors and garbage)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rlsearch.config import JudgeConfig, RewardConfig
from rlsearch.reward import RewardScorer
from tests.integration.judge_stub import Scripted, answered, row, stub_judge

_ANSWER = re.compile(r"Agent's answer: (.*)")
VLLM_START_TIMEOUT_S = 240


def _by_answer(replies: dict[str, str]):
    """A script replying by the agent's answer in the prompt."""
    return lambda prompt, attempt: Scripted(replies[_ANSWER.search(prompt)[1].strip()])


def _scorer(url: str, cache_dir: Path | str = "", model: str = "stub-judge", **judge) -> RewardScorer:
    config = RewardConfig(format_score=0.1, scorers={"judged": "judge"},
                          judge=JudgeConfig(base_url=url, model=model, cache_dir=str(cache_dir), **judge))
    return RewardScorer(config)


def test_verdicts_end_to_end_then_every_reply_from_the_cache(tmp_path) -> None:
    replies = {"a": "Verdict: correct", "b": "CORRECT", "c": '{"correct": false}', "d": "yes",
               "e": "Score: 8/10", "f": "no"}
    with stub_judge(_by_answer(replies)) as (stub, url):
        scorer = _scorer(url, tmp_path / "cache")
        texts = [f"<search>x</search><answer>{answer}</answer>" for answer in replies] + ["no answer block"]
        trajectories = [answered(text, i) for i, text in enumerate(texts)]
        stats = scorer.score(trajectories, [row()] * len(texts))
        assert [t.reward for t in trajectories] == [1.0, 1.0, 0.1, 1.0, 1.0, 0.1, 0.0]
        assert [t.scores["correct"] for t in trajectories] == [1, 1, 0, 1, 1, 0, 0]
        assert stats == {"reward/judged": 7, "reward/judge_requests": 6, "reward/judge_cache_hits": 0,
                         "reward/judge_failures": 0, "reward/judge_failovers": 0}
        assert len(list((tmp_path / "cache").glob("*/*.json"))) == 6
        assert not list((tmp_path / "cache").glob("*/*.tmp-*"))
        # the same responses again, by a new scorer (a new process): no request reaches the judge
        again = [answered(text, i) for i, text in enumerate(texts)]
        stats = _scorer(url, tmp_path / "cache").score(again, [row()] * len(texts))
        assert [t.reward for t in again] == [t.reward for t in trajectories]
        assert stats["reward/judge_requests"] == 0 and stats["reward/judge_cache_hits"] == 6
        assert len(stub.prompts) == 6
        scorer.close()


def test_a_replay_scores_from_the_recorded_replies_alone_and_names_a_missing_prompt(tmp_path) -> None:
    from rlsearch.reward.judge import JudgeReplayMissError

    texts = ["<answer>a</answer>", "<answer>b</answer>"]
    with stub_judge(_by_answer({"a": "Verdict: correct", "b": "no"})) as (_, url):
        recorded = [answered(text, i) for i, text in enumerate(texts)]
        _scorer(url, tmp_path / "judge_cache").score(recorded, [row()] * 2)
    # the judge is gone: a replay sends nothing, so it scores all the same
    replay = _scorer(url, tmp_path / "judge_cache", replay=True)
    again = [answered(text, i) for i, text in enumerate(texts)]
    stats = replay.score(again, [row()] * 2)
    assert [t.reward for t in again] == [t.reward for t in recorded] == [1.0, 0.1]
    assert stats["reward/judge_requests"] == 0 and stats["reward/judge_cache_hits"] == 2
    with pytest.raises(JudgeReplayMissError, match="has no reply of stub-judge to the prompt .*Agent's answer: c"):
        replay.score([answered("<answer>c</answer>", 0)], [row()])
    replay.close()


def test_a_replay_fails_a_trajectory_where_the_recorded_judge_failed_and_a_run_asks_again(tmp_path) -> None:
    """A request that failed (every attempt: the judge was down, or too slow) is kept as a failure: the replay fails
    the same trajectory with the same message and scores the others as recorded; a run asks it again."""
    texts = ["<answer>a</answer>", "<answer>down</answer>"]
    script = _by_answer({"a": "Verdict: correct"})
    with stub_judge(lambda prompt, attempt: Scripted(status=503) if "down" in prompt else script(prompt, attempt)) \
            as (_, url):
        recorded = [answered(text, i) for i, text in enumerate(texts)]
        _scorer(url, tmp_path / "judge_cache", max_retries=0).score(recorded, [row()] * 2)
    assert recorded[1].failed == "judge: 1 attempt(s) failed, the last: HTTP 503"
    replay = _scorer(url, tmp_path / "judge_cache", replay=True)
    again = [answered(text, i) for i, text in enumerate(texts)]
    stats = replay.score(again, [row()] * 2)
    replay.close()
    assert [(t.reward, t.failed) for t in again] == [(t.reward, t.failed) for t in recorded]
    assert stats["reward/judge_requests"] == 0 and stats["reward/judge_failures"] == 1
    with stub_judge(_by_answer({"a": "Verdict: correct", "down": "Verdict: correct"})) as (stub, url):
        rerun = [answered(texts[1], 0)]
        _scorer(url, tmp_path / "judge_cache").score(rerun, [row()])
    assert not rerun[0].failed and rerun[0].reward == 1.0 and len(stub.prompts) == 1  # asked again, then kept


def test_request_rate_is_held_at_the_judge() -> None:
    interval_s = 0.1
    with stub_judge(lambda prompt, attempt: Scripted("Verdict: correct")) as (stub, url):
        scorer = _scorer(url, requests_per_minute=60 / interval_s, max_concurrency=8)
        scorer.score([answered("<answer>warm-up</answer>")], [row()])  # the client's set-up (2 s here) comes first
        trajectories = [answered(f"<answer>city {i}</answer>", i) for i in range(10)]
        asked = time.monotonic()
        scorer.score(trajectories, [row()] * 10)
        scorer.close()
    arrivals = sorted(stub.started[1:])
    assert len(arrivals) == 10
    # request k of these leaves the client k intervals after `asked` at the earliest and arrives later still: a bound
    # from below, which no machine's slowness breaks (without the limit the 8 slots' requests arrive within 0.1 s)
    assert [k for k, arrived in enumerate(arrivals) if arrived - asked < k * interval_s - 1e-3] == []


def test_concurrency_is_held_at_the_judge_and_requests_overlap() -> None:
    # each request answered only once three are in flight at once (serial requests end at the stub's hang guard)
    with stub_judge(lambda prompt, attempt: Scripted("Verdict: correct", delay_s=0.3), meet=3) as (stub, url):
        scorer = _scorer(url, max_concurrency=3)
        trajectories = [answered(f"<answer>city {i}</answer>", i) for i in range(12)]
        stats = scorer.score(trajectories, [row()] * 12)
        scorer.close()
    assert (stub.in_flight.calls, stub.in_flight.most) == (12, 3)
    assert stats["reward/judge_requests"] == 12 and all(t.reward == 1.0 for t in trajectories)


def test_timeouts_and_server_errors_are_retried_then_fail_the_trajectory() -> None:
    def script(prompt: str, attempt: int) -> Scripted:
        answer = _ANSWER.search(prompt)[1]
        if answer == "slow-then-ok":
            return Scripted("Verdict: correct", delay_s=2.0 if attempt == 1 else 0.0)
        if answer == "500-then-ok":
            return Scripted("Verdict: correct", status=500 if attempt == 1 else 200)
        if answer == "429-then-ok":
            return Scripted("Verdict: incorrect", status=429 if attempt == 1 else 200)
        return {"always-500": Scripted(status=503), "always-slow": Scripted(delay_s=2.0),
                "refused": Scripted(status=400)}[answer]

    answers = ["slow-then-ok", "500-then-ok", "429-then-ok", "always-500", "always-slow", "refused"]
    with stub_judge(script) as (stub, url):
        scorer = _scorer(url, timeout_s=0.5, max_retries=2, backoff_s=0.05)
        trajectories = [answered(f"<answer>{answer}</answer>", i) for i, answer in enumerate(answers)]
        stats = scorer.score(trajectories, [row()] * len(answers))
        scorer.close()
    assert [t.reward for t in trajectories[:3]] == [1.0, 1.0, 0.1] and not any(t.failed for t in trajectories[:3])
    assert trajectories[3].failed == "judge: 3 attempt(s) failed, the last: HTTP 503"
    assert trajectories[4].failed == "judge: 3 attempt(s) failed, the last: timed out after 0.5 s"
    assert trajectories[5].failed.startswith("judge: HTTP 400")  # not transient: no retry
    assert [stub.attempts[p] for p in sorted(stub.attempts, key=lambda p: answers.index(_ANSWER.search(p)[1]))] == [
        2, 2, 2, 3, 3, 1]
    assert stats["reward/judge_requests"] == 13 and stats["reward/judge_failures"] == 3


def test_garbage_verdict_is_excluded_and_counted_never_scored_zero(tmp_path) -> None:
    replies = {"good": "Verdict: incorrect", "garbage": "The weather is nice today.", "empty": ""}
    with stub_judge(_by_answer(replies)) as (stub, url):
        scorer = _scorer(url, tmp_path)
        trajectories = [answered(f"<answer>{answer}</answer>", i) for i, answer in enumerate(replies)]
        failed_agent = answered("<answer>good</answer>", 3)
        failed_agent.failed = "the agent raised RuntimeError: bug"
        stats = scorer.score([*trajectories, failed_agent], [row()] * 4)
        good, garbage, empty = trajectories
        assert good.reward == 0.1 and good.scores["correct"] == 0 and not good.failed
        assert garbage.failed == "judge: no verdict in the reply 'The weather is nice today.'"
        assert empty.failed == "judge: no verdict in the reply ''"
        # a failure has no verdict: nothing says it was judged wrong, and the trainer leaves it out (failed)
        assert "correct" not in garbage.scores and "correct" not in empty.scores
        assert failed_agent.failed.startswith("the agent raised") and "correct" not in failed_agent.scores
        assert stats == {"reward/judged": 3, "reward/judge_requests": 3, "reward/judge_cache_hits": 0,
                         "reward/judge_failures": 2, "reward/judge_failovers": 0}
        # cached garbage stays a failure, without asking again
        again = answered("<answer>garbage</answer>")
        stats = scorer.score([again], [row()])
        assert again.failed.startswith("judge: no verdict") and stats["reward/judge_requests"] == 0
        assert stats["reward/judge_failures"] == 1
        scorer.close()


def test_custom_prompt_file_with_json_braces(tmp_path) -> None:
    template = tmp_path / "judge.txt"
    template.write_text('Q={question} G={golden_answers} A={response}\nReply as JSON: {"correct": true|false}\n')
    with stub_judge(lambda prompt, attempt: Scripted('{"correct": true}')) as (stub, url):
        scorer = _scorer(url, prompt_file=str(template))
        scorer.score([answered("<answer>Paris</answer>")], [row(golden=("Paris", "City of Light"))])
        scorer.close()
    assert stub.prompts == ['Q=What is the capital of France? G=Paris; City of Light A=Paris\n'
                            'Reply as JSON: {"correct": true|false}\n']


@pytest.fixture(scope="module")
def vllm_judge_url(tiny_model_dir) -> Iterator[str]:
    """The tiny random model served by vLLM's OpenAI server (CPU, in-process engine core) as a judge."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model_dir),
        "--served-model-name", "tiny-judge", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024",
        "--dtype", "float32", "--enforce-eager", "--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048",
        "--disable-log-stats",
    ]
    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + VLLM_START_TIMEOUT_S
        while True:
            try:
                if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"the vLLM judge did not start:\n{server.stdout.read()[-4000:]}")
            time.sleep(1)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def test_vllm_served_model_as_the_judge(vllm_judge_url, tmp_path) -> None:
    """A random model's replies are classified: a verdict (scored 0/1) or none (failed, counted), never a crash."""
    scorer = _scorer(vllm_judge_url, tmp_path / "cache", model="tiny-judge", max_tokens=8, max_concurrency=4)
    texts = [f"<answer>{answer}</answer>" for answer in ("Paris", "Lyon", "Marseille", "the capital")]
    trajectories = [answered(text, i) for i, text in enumerate(texts)]
    stats = scorer.score(trajectories, [row()] * 4)
    failed = [t for t in trajectories if t.failed]
    assert stats["reward/judge_requests"] == 4 and stats["reward/judge_failures"] == len(failed)
    print(f"\nthe random judge's replies: {4 - len(failed)} with a verdict, {len(failed)} without")
    # each of the four replies classified: a verdict scored 0 or 1, or none (the trajectory failed)
    assert [t.scores["correct"] in (0.0, 1.0) if not t.failed else t.failed.startswith("judge: no verdict in the reply")
            for t in trajectories] == [True] * 4
    records = [json.loads(path.read_text()) for path in (tmp_path / "cache").glob("*/*.json")]
    assert len(records) == 4 and {record["model"] for record in records} == {"tiny-judge"}
    again = [answered(text, i) for i, text in enumerate(texts)]
    stats = scorer.score(again, [row()] * 4)  # greedy replies, cached: the same classification, no request
    assert stats["reward/judge_requests"] == 0 and [t.failed for t in again] == [t.failed for t in trajectories]
    scorer.close()
