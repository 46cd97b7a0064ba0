"""The evolving rubrics' generator against a scripted OpenAI-compatible server on 127.0.0.1: what it is shown, a good
reply, a malformed one, a dead generator (failover, counted), the cache and replay."""

from __future__ import annotations

import asyncio
import json

import pytest

from rlsearch.config import EndpointConfig, EvolveConfig, JudgeConfig, RewardConfig, RubricConfig
from rlsearch.data import Rubric
from rlsearch.reward.evolving import EvolvingRubric, RubricBuffer
from rlsearch.reward.judge import JudgeReplayMissError
from rlsearch.reward.rubric_generator import GeneratorCounters, RubricGenerator, parse_generated
from rlsearch.rollout import ToolCallRecord, Turn
from tests.integration.judge_stub import Scripted, answered, stub_judge
from tests.integration.threaded_server import closed_port

QUESTION = "Why did the Velmora guild collapse?"
GOOD = ('Here you go:\n```json\n{"question": "q", "positive_rubrics": [{"title": "Cause", "description": '
        '"Names the 1702 flood as the cause"}], "negative_rubrics": [{"title": "Date", "description": '
        '"Dates the collapse to 1800"}]}\n```')
PERSISTENT = (Rubric("cites a primary source", 2.0),)


def rollouts() -> list:
    searched = answered("<answer>The 1702 flood.</answer>", 0)
    searched.turns = [
        Turn(text="<call_tool>velmora guild</call_tool>", num_tokens=4, kind="tool_call",
             tool_calls=[ToolCallRecord(name="search", query="velmora guild", ok=True)],
             observation="<snippet id=s1>The flood of 1702 ruined the guild.</snippet>"),
        Turn(text="<answer>The 1702 flood.</answer>", num_tokens=4, kind="answer"),
    ]
    searched.assistant_prefix = ""
    return [searched, answered("<answer>It collapsed in 1800.</answer>", 1)]


def config(endpoints: list[EndpointConfig], cache_dir: str = "", replay: bool = False, **evolve) -> RewardConfig:
    judge = JudgeConfig(base_url="http://127.0.0.1:9/v1", model="judge-model", max_retries=0, timeout_s=5.0,
                        cooldown_s=60.0, cache_dir=cache_dir, replay=replay)
    return RewardConfig(judge=judge, rubric=RubricConfig(evolve=EvolveConfig(enabled=True, endpoints=endpoints,
                                                                             **evolve)))


def generate(reward: RewardConfig, existing=PERSISTENT) -> tuple[list[EvolvingRubric] | None, GeneratorCounters,
                                                                    int]:
    """(the rubrics, the counters, the failovers) of one call for `rollouts`."""
    async def run():
        generator = RubricGenerator(reward)
        counters = GeneratorCounters()
        try:
            rubrics = await generator.generate(QUESTION, rollouts(), existing, counters)
        finally:
            await generator.close()
        return rubrics, counters, generator.client.endpoints.failovers

    return asyncio.run(run())


def test_a_good_reply_gives_weighted_rubrics_and_the_prompt_shows_everything() -> None:
    with stub_judge(lambda prompt, attempt: Scripted(GOOD)) as (stub, url):
        rubrics, counters, _ = generate(config([EndpointConfig(url, "generator-model")]))
    assert rubrics == [EvolvingRubric("Names the 1702 flood as the cause", 1.0, title="Cause"),
                       EvolvingRubric("Dates the collapse to 1800", -1.0, title="Date")]
    assert (counters.calls, counters.failures, counters.requests.requests) == (1, 0, 1)
    prompt = stub.prompts[0]
    assert f"Question: {QUESTION}" in prompt
    # the whole rollout, the tool output included, then the second response
    assert ("Response 1:\n<call_tool>velmora guild</call_tool><snippet id=s1>The flood of 1702 ruined the guild."
            "</snippet><answer>The 1702 flood.</answer>\n\nResponse 2:\n<answer>It collapsed in 1800.</answer>"
            in prompt)
    assert 'Existing rubrics:\n[{"description": "cites a primary source", "weight": 2.0}]' in prompt


def test_answers_only_shows_the_answer_blocks() -> None:
    with stub_judge(lambda prompt, attempt: Scripted(GOOD)) as (stub, url):
        generate(config([EndpointConfig(url, "generator-model")], use_full_responses_for_adaptive_rubric=False))
    assert "Response 1:\nThe 1702 flood.\n\nResponse 2:\nIt collapsed in 1800.\n" in stub.prompts[0]
    assert "snippet" not in stub.prompts[0]


def test_a_malformed_reply_is_a_counted_failure_and_the_group_keeps_its_active_rubrics() -> None:
    buffer = RubricBuffer()
    rubrics = buffer.question("q", PERSISTENT)
    buffer.add("q", [EvolvingRubric("names the flood", 1.0)], step=1)
    with stub_judge(lambda prompt, attempt: Scripted('{"positive_rubrics": [{"title": "no description"')) as (_, url):
        generated, counters, _ = generate(config([EndpointConfig(url, "generator-model")]),
                                          existing=rubrics.scoring_rubrics())
    assert generated is None and (counters.calls, counters.failures) == (1, 1)
    assert counters.last_failure.startswith("no rubrics in the reply '{\"positive_rubrics\"")
    assert [rubric.text for rubric in rubrics.active] == ["names the flood"]  # nothing was taken away


def test_a_dead_generator_fails_over_to_the_next_and_all_dead_is_a_counted_failure() -> None:
    dead = f"http://127.0.0.1:{closed_port()}/v1"
    with stub_judge(lambda prompt, attempt: Scripted(GOOD)) as (stub, url):
        rubrics, counters, failovers = generate(config([EndpointConfig(dead, "a"), EndpointConfig(url, "b")]))
    assert len(rubrics) == 2 and failovers == 1
    assert (counters.calls, counters.failures, counters.requests.requests) == (1, 0, 2)
    rubrics, counters, failovers = generate(config([EndpointConfig(dead, "a")]))
    assert rubrics is None and (counters.calls, counters.failures, counters.requests.requests) == (1, 1, 1)
    assert counters.last_failure.startswith("1 attempt(s) failed, the last: connection error")


def test_without_its_own_endpoints_it_asks_the_judge_and_replays_from_the_cache(tmp_path) -> None:
    cache = str(tmp_path / "judge_cache")
    with stub_judge(lambda prompt, attempt: Scripted(GOOD)) as (stub, url):
        reward = config([], cache_dir=cache)
        reward.judge.base_url = url
        first, _, _ = generate(reward)
        again, counters, _ = generate(reward)
    assert len(stub.prompts) == 1 and counters.requests.cache_hits == 1 and again == first
    reward.judge.base_url = f"http://127.0.0.1:{closed_port()}/v1"
    reward.judge.replay = True
    replayed, counters, _ = generate(reward)
    assert replayed == first and counters.requests.requests == 0
    with pytest.raises(JudgeReplayMissError, match="has no reply of judge-model"):
        generate(reward, existing=())


@pytest.mark.parametrize(("reply", "expected"), [
    ('<think>{"x": 1}</think>{"positive_rubrics": ["States the cause"], "negative_rubrics": []}',
     [EvolvingRubric("States the cause", 1.0)]),
    ('{"positive_rubrics": [], "negative_rubrics": []}', []),  # nothing to add: not a failure
    (json.dumps({"positive_rubrics": [f"p{index}" for index in range(4)], "negative_rubrics": ["n0", "n1"]}),
     [*(EvolvingRubric(f"p{index}", 1.0) for index in range(4)), EvolvingRubric("n0", -1.0)]),  # 5 at most
    ('{"positive_rubrics": [{"title": "t"}, {"description": "kept"}]}', [EvolvingRubric("kept", 1.0)]),
    ("I think the rubrics are fine.", None),
    ('{"positive_rubrics": "Names the cause"}', None),
    ('{"rubrics": [{"description": "x"}]}', None),
    ('{"negative_rubrics": [{"title": "t"}, 3]}', None),
])
def test_parse_generated(reply, expected) -> None:
    assert parse_generated(reply) == expected
