"""Rollouts in the <call_tool> protocol through `rlsearch serve-mcp` over real HTTP, with a real vLLM engine.

A random-init model reaches the tool path because the opening tag is prefilled and the closing tag's tokens are
biased (as in the Search-R1 rollout test). A second set of tests replays scripted turns token-exactly through the
same agent loop, so every limit and error kind is hit on purpose.
"""

import asyncio
from types import SimpleNamespace

import pytest
import ray

from rlsearch.config import MCPConfig, MCPServerConfig, RetrieverConfig, RolloutConfig, ToolsConfig
from rlsearch.data import load_qa_dataset
from rlsearch.rollout import AgentLoop, PromptItem
from rlsearch.tools import ErrorKind, build_registry, make_protocol
from rlsearch.trainer.metrics import trajectory_metrics
from tests.constants import TEST_KV_CACHE_GIB
from tests.integration.rollout_checks import assert_masks_follow_turns, prompt_items

# The closing tag is 4 tokens; with this bias some samples write it within a turn (which ones depends on the CPU's
# sample path: the tests find them in the run). A sample's seed is its own (step, group, sample), so a step run again,
# whole or in part, makes the same calls.
CALL_TOOL_ROLLOUT = {
    "protocol": "call_tool", "max_turns": 3, "max_response_tokens": 400, "max_tokens_per_turn": 96,
    "assistant_prefix": '<call_tool name="search">', "logit_bias": {"</call_tool>": 16.0},
    "max_observation_tokens": 96,
}


def mcp_tools(url: str, **mcp) -> ToolsConfig:
    return ToolsConfig(enabled=[], mcp=MCPConfig(servers=[MCPServerConfig(url=url)], **mcp))


@pytest.fixture(scope="module")
def call_tool_worker(ray_local, tiny_model_dir, mcp_server):
    from rlsearch.rollout import EngineSpec, RolloutWorker

    # max_concurrency=2: tool_stats can be read while a rollout runs
    worker = ray_local.remote(RolloutWorker).options(num_cpus=0, max_concurrency=2).remote(
        EngineSpec(str(tiny_model_dir), kv_cache_gib=TEST_KV_CACHE_GIB, max_model_len=1024),
        RolloutConfig(**CALL_TOOL_ROLLOUT), RetrieverConfig(),
        "", 1, tools=mcp_tools(mcp_server.url, timeout_s=5.0, max_retries=1, backoff_s=0.05),
    )
    yield worker
    ray_local.kill(worker)


def test_call_tool_rollout_through_mcp_records_outputs_masks_and_metrics(call_tool_worker, toy_data, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    trajectories = ray.get(call_tool_worker.generate.remote(prompt_items(toy_data), 1))
    assert len(trajectories) == 8
    assert sum(assert_masks_follow_turns(t, tokenizer) for t in trajectories) >= 1
    answered = [turn for t in trajectories for turn in t.turns if turn.tool_calls and turn.tool_calls[0].ok]
    assert answered, "the prefilled <call_tool name=\"search\"> must reach the MCP server at least once"
    for turn in answered:
        assert turn.observation.startswith("\n<tool_output>\n") and turn.observation.endswith("</tool_output>\n")
        assert "<snippet id=" in turn.observation or "No results." in turn.observation
        assert len(tokenizer.encode(turn.observation)) <= CALL_TOOL_ROLLOUT["max_observation_tokens"]
    metrics = trajectory_metrics(trajectories)
    dispatched = [call for t in trajectories for call in t.dispatched_calls]
    assert metrics["rollout/tool_calls/search"] == sum(call.name == "search" for call in dispatched) >= len(answered)
    error_turns = [turn for t in trajectories for turn in t.turns if turn.error_kind]
    assert sum(metrics[f"rollout/errors/{kind.value}"] for kind in ErrorKind) == len(error_turns)
    assert ray.get(call_tool_worker.tool_stats.remote())["requests"] >= len(answered)


def test_call_tool_rollout_survives_mcp_server_kill_and_recovers_after_restart(call_tool_worker, mcp_server, toy_data):
    every = prompt_items(toy_data, samples=4)
    calling = [t for t in ray.get(call_tool_worker.generate.remote(every, 3)) if t.dispatched_calls]
    assert calling, "no sample of step 3 reached the MCP server"
    prompts = [item for item in every if (item.group_id, item.sample_index) in
               {(t.group_id, t.sample_index) for t in calling}]
    healthy = ray.get(call_tool_worker.generate.remote(prompts, 3))
    assert [t.response_ids for t in healthy] == [t.response_ids for t in calling]  # the same samples, in part
    calls_when_healthy = [c for t in healthy for c in t.dispatched_calls]
    assert calls_when_healthy and all(c.ok for c in calls_when_healthy)
    failures_before = ray.get(call_tool_worker.tool_stats.remote())["failures"]
    # the same step again (same seeds, same calls), with the server killed while the rollout is generating
    in_flight = call_tool_worker.generate.remote(prompts, 3)
    mcp_server.kill()
    try:
        killed = ray.get(in_flight, timeout=120)
    finally:
        mcp_server.start()  # same port
    failed = [turn for t in killed for turn in t.turns if turn.tool_calls and not turn.tool_calls[0].ok]
    assert len(failed) == len(calls_when_healthy)
    for turn in failed:
        assert turn.error_kind == "tool_error"
        assert turn.observation.startswith("\n<tool_output>\nError: search failed: MCP server http://127.0.0.1:")
    assert trajectory_metrics(killed)["rollout/errors/tool_error"] == len(failed)
    assert ray.get(call_tool_worker.tool_stats.remote())["failures"] - failures_before == len(failed)
    recovered = ray.get(call_tool_worker.generate.remote(prompts, 3))
    assert [c.ok for t in recovered for c in t.dispatched_calls] == [True] * len(calls_when_healthy)
    assert [t.response_ids for t in recovered] == [t.response_ids for t in healthy]


class ScriptedEngine:
    """Replays fixed model turns token-exactly, as a vLLM engine would return them (text cut after the stop string,
    finish_reason/stop_reason set), so the agent loop meets every limit and error on purpose."""

    weight_version = 0

    def __init__(self, tokenizer, stop_strings: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.scripts: list[tuple[list[int], list[str]]] = []  # (prompt ids, turns)

    async def generate(self, prompts: list[list[int]], sampling_params: list) -> list:
        return [self._next_turn(ids) for ids in prompts]

    def _next_turn(self, ids: list[int]):
        for prompt, turns in self.scripts:
            if ids[: len(prompt)] == prompt:
                text = turns.pop(0)
                break
        stop = next((s for s in self.stop_strings if s in text), None)
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        completion = SimpleNamespace(
            text=text, token_ids=token_ids, logprobs=[{t: SimpleNamespace(logprob=-1.0)} for t in token_ids],
            finish_reason="stop" if stop else "length", stop_reason=stop,
        )
        return SimpleNamespace(outputs=[completion], num_cached_tokens=0)


def test_call_tool_limits_and_errors_become_observations_counted_per_kind(mcp_server, tiny_model_dir, toy_data):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = RolloutConfig(
        protocol="call_tool", max_turns=6, max_response_tokens=2000, max_tool_calls=3,
        max_calls_per_tool={"browse": 1}, max_observation_tokens=48,
    )
    registry = build_registry(mcp_tools(mcp_server.url, timeout_s=10.0), RetrieverConfig(), "")
    protocol = make_protocol("call_tool", registry.specs)
    engine = ScriptedEngine(tokenizer, protocol.stop_strings)
    loop = AgentLoop(engine, protocol, registry, config, seed=1)
    within_limits = [
        '<think>find it</think><call_tool name="search" topk="5">town river mayor founded</call_tool>',
        '<call_tool name="browse">local://corpus/1</call_tool>',
        '<call_tool name="browse">local://corpus/2</call_tool>',  # 2nd browse: over the per-tool limit
        '<call_tool name="search">river</call_tool>',  # 3rd counted call
        '<call_tool name="search">again</call_tool>',  # 4th: over max_tool_calls
        "<answer> Mebri </answer>",
    ]
    mistakes = [
        '<call_tool name="google">x</call_tool>',
        '<call_tool name="search">   </call_tool>',
        "no opening tag</call_tool>",
        '<call_tool name="search" topk="lots">q</call_tool>',
        "<answer> x </answer>",
    ]
    examples = load_qa_dataset(toy_data.train)[:2]
    for example, turns in zip(examples, (within_limits, mistakes)):
        engine.scripts.append((loop.prompt_ids(example.question), list(turns)))
    prompts = [PromptItem(e.id, e.question, group_id=i, sample_index=0) for i, e in enumerate(examples)]
    good, bad = asyncio.run(loop.run(prompts, 1))

    assert [t.error_kind for t in good.turns] == [None, None, "over_limit", None, "over_limit", None]
    assert [t.error_kind for t in bad.turns] == ["unknown_tool", "empty_query", "unparseable", "tool_error", None]
    assert good.finish_reason == bad.finish_reason == "answer"
    truncated = good.turns[0].observation
    assert truncated.count("<snippet id=") >= 1 and truncated.endswith("</snippet>\n</tool_output>\n")
    assert len(tokenizer.encode(truncated)) <= 48
    assert good.turns[1].observation.startswith("\n<tool_output>\n<webpage id=1>")
    assert "the limit of 1 calls to 'browse' is reached" in good.turns[2].observation
    assert "the limit of 3 tool calls is reached" in good.turns[4].observation
    assert "unknown tool 'google'; available tools: search, browse" in bad.turns[0].observation
    assert "search failed: tool 'search': parameter 'topk' must be of type integer" in bad.turns[3].observation
    for trajectory in (good, bad):
        assert assert_masks_follow_turns(trajectory, tokenizer) == len(trajectory.turns) - 1
    metrics = trajectory_metrics([good, bad])
    assert (metrics["rollout/tool_calls/search"], metrics["rollout/tool_calls/browse"]) == (3.0, 1.0)
    assert {kind.value: metrics[f"rollout/errors/{kind.value}"] for kind in ErrorKind} == {
        "unparseable": 1.0, "empty_query": 1.0, "unknown_tool": 1.0, "over_limit": 2.0, "timeout": 0.0,
        "tool_error": 1.0, "not_run": 0.0,
    }
    registry.close()
