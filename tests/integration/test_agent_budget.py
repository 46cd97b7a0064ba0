"""User agents are held to one token budget: `rollout.max_response_tokens` counts every token after the first prompt,
whichever segment a call starts. An agent that strips the stop string before sending its history back (what
OpenAI-style agents do) starts a new segment with every call; its trajectory still never holds more than the budget,
and the call that would pass it ends the trajectory as `length` (so overlong masking applies), not as failed.
An agent whose tools are all MCP tools starts under the default protocol (search_r1), whose format names `search`.
"""

from __future__ import annotations

import sys

import openai
import pytest

from rlsearch.config import AlgoConfig, MCPConfig, MCPServerConfig, RetrieverConfig, RolloutConfig, ToolsConfig
from rlsearch.rollout.worker import rollout_protocol
from rlsearch.tools import ToolSetupError, build_registry
from rlsearch.trainer.step_batch import train_samples
from tests.integration.engine_bench import prompt_items

BUDGET = 120  # rollout.max_response_tokens of these runs
STOP = ">"  # the agent's stop string; a bias makes the random model write it within a few tokens
ROLLOUT = {"max_response_tokens": BUDGET, "max_tokens_per_turn": 24, "logit_bias": {STOP: 10.0}, "assistant_prefix": ""}


def stripping_agent(calls_made: dict):
    """Search-R1 turns through chat calls: each reply's stop string is stripped before it goes back into the history,
    with the search result as a user message; it searches until the endpoint refuses a call (the budget)."""

    async def agent(session, example) -> str:
        client = session.openai()
        messages = [{"role": "user", "content": example.question}]
        for turn in range(20):
            reply = await client.chat.completions.create(model=session.model, messages=messages, stop=[STOP],
                                                         max_tokens=24)
            calls_made[example.group_id, example.sample_index] = turn + 1
            content = reply.choices[0].message.content.replace(STOP, "")
            messages.append({"role": "assistant", "content": content})
            result = await session.tools.call("search", content.strip() or example.question)
            text = " ".join(document.text for document in result.documents)
            messages.append({"role": "user", "content": f"<information>{text[:200]}</information>"})
        return "never reached"

    return agent


def test_a_stripping_agent_is_held_to_one_budget_and_its_overflow_ends_as_length(engine_bench, toy_data):
    calls_made: dict = {}
    trajectories = engine_bench.agent(stripping_agent(calls_made), prompt_items(toy_data, prompts=4, samples=2),
                                      step=1, **ROLLOUT)
    for trajectory in trajectories:
        assert not trajectory.failed
        assert trajectory.finish_reason == "length"
        first_prompt = len(trajectory.segments[0].prompt_ids)
        # every segment is a model call's context: it holds at most the budget after the first prompt
        held = [len(s.prompt_ids) + len(s.response_ids) - first_prompt for s in trajectory.segments]
        assert max(held) <= BUDGET, held
        # the calls re-rendered the stripped history: new segments (a reply cut by max_tokens has nothing to strip,
        # and the next call extends it)
        assert calls_made[trajectory.group_id, trajectory.sample_index] >= len(trajectory.segments) >= 2
        assert trajectory.truncations == ["response_budget"]
        # every call records the weight version that sampled it and what its context was
        assert all(turn.weight_versions == trajectory.weight_versions for turn in trajectory.turns)
        assert all(turn.context_tokens >= first_prompt for turn in trajectory.turns)
        assert all(0 <= turn.cached_tokens and turn.cache_ceiling <= turn.context_tokens for turn in trajectory.turns)
    # the overflow is a cut by length: with algo.overlong=mask none of these trajectories trains a token
    for trajectory, reward in zip(trajectories, [1.0, 0.0] * 4):
        trajectory.reward = reward
    masked = train_samples(trajectories, AlgoConfig(overlong="mask"))
    assert masked and all(sum(sample.token_weights) == 0.0 for sample in masked)
    assert any(sum(sample.token_weights) > 0.0 for sample in train_samples(trajectories, AlgoConfig()))


def test_an_agent_whose_context_fills_the_window_is_cut_and_counted(engine_bench, toy_data):
    """With a budget that never runs out, the call whose prompt fills rollout.context_window is refused: the
    trajectory ends as cut by the window (not failed), and no call ever saw more than the window."""
    items = prompt_items(toy_data, prompts=2, samples=1)
    window = len(engine_bench.loop().prompt_ids(items[0].question)) + 120
    trajectories = engine_bench.agent(stripping_agent({}), items, step=1,
                                      **{**ROLLOUT, "max_response_tokens": 4000, "context_window": window})
    for trajectory in trajectories:
        assert not trajectory.failed and trajectory.finish_reason == "context"
        assert trajectory.truncations == ["context_window"]
        assert max(len(s.prompt_ids) + len(s.response_ids) for s in trajectory.segments) <= window


def test_the_first_prompt_over_max_prompt_tokens_is_refused(engine_bench, toy_data):
    seen: dict = {}

    async def agent(session, example):
        try:
            await session.openai().chat.completions.create(
                model=session.model, messages=[{"role": "user", "content": example.question * 100}], max_tokens=4)
        except openai.BadRequestError as error:
            seen["error"] = error.message
            raise

    (trajectory,) = engine_bench.agent(agent, prompt_items(toy_data, prompts=1, samples=1), step=1)
    assert "over the limit of rollout.max_prompt_tokens=512" in seen["error"]
    assert trajectory.failed.startswith("the agent raised BadRequestError")


def test_an_agent_with_only_mcp_tools_starts_under_the_default_protocol(tiny_model_dir):
    time_server = MCPServerConfig(command=[sys.executable, "-m", "mcp_server_time", "--local-timezone", "UTC"])
    tools = build_registry(ToolsConfig(enabled=[], mcp=MCPConfig(servers=[time_server], timeout_s=20)),
                           RetrieverConfig(), "")
    try:
        assert {spec.name for spec in tools.specs} == {"get_current_time", "convert_time"}
        agent = RolloutConfig(agent="examples.agents.search_r1:agent")
        assert agent.protocol == "search_r1"
        protocol = rollout_protocol(agent, tools, str(tiny_model_dir))
        assert protocol.required_tools == ("search",)
        # the built-in loop does need the tools its format names
        with pytest.raises(ToolSetupError, match="calls the tool.s. search, which no enabled tool provides"):
            rollout_protocol(RolloutConfig(), tools, str(tiny_model_dir))
    finally:
        tools.close()
