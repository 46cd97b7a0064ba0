"""The browse agent: `browse` hands each fetched page to a second, frozen vLLM engine of the run (a Ray actor,
tools.browse.summariser.engine) and the policy sees its summary. The policy is the shared in-process engine
(`engine_bench`), the actor the shared Megatron rank (`actor_ranks`): two GRPO steps with the engine following the
actor, the summaries the observations (loss mask 0), and a replay from the tool store with no live call.

The tiny policy reaches the tool through a prefilled native call (rollout.protocol=chat_tools) and a biased
end-of-turn token, as in test_chat_tools_rollout."""

from __future__ import annotations

import dataclasses
import json

import pytest
import ray
import torch
from starlette.applications import Starlette
from starlette.responses import HTMLResponse
from starlette.routing import Route
from threaded_server import serve_in_thread

from rlsearch.actor import TrainSample
from rlsearch.algo import grpo_advantages, loss_token_weights
from rlsearch.config import BrowseConfig, RetrieverConfig, RolloutConfig, SummariserConfig, ToolsConfig
from rlsearch.config.prompt import PromptFile
from rlsearch.rollout import AgentLoop, start_frozen_summariser
from rlsearch.tools import Document, build_registry, make_protocol
from rlsearch.tools.clients.summarise import SUMMARY_PROMPT
from tests.integration.engine_bench import prompt_items
from tests.integration.rollout_checks import assert_masks_follow_turns

PAGE_TITLE = "Velmora"
PAGE_TEXT = "RAWPAGE Velmora is a river town founded by Ada Brun in 1702."
SUMMARY_TOKENS = 12


def page(_):
    return HTMLResponse(f"<html><head><title>{PAGE_TITLE}</title></head><body><p>{PAGE_TEXT}</p></body></html>")


@pytest.fixture(scope="module")
def site():
    with serve_in_thread(Starlette(routes=[Route("/{path:path}", page)])) as url:
        yield f"{url}/velmora"


@pytest.fixture(scope="module")
def summariser_engine(ray_local, tiny_model_dir):
    """The frozen engine, started as the run starts it (its Ray name filled into the tools config)."""
    summariser = SummariserConfig(engine=str(tiny_model_dir), engine_max_model_len=1024, max_tokens=SUMMARY_TOKENS,
                                  max_page_chars=400)
    tools = ToolsConfig(enabled=["browse"], browse=BrowseConfig(allow_networks=["127.0.0.0/8"], summariser=summariser))
    tools, engine = start_frozen_summariser(tools, seed=1)
    yield tools, engine
    ray.get(engine.shutdown.remote(), timeout=60)
    ray.kill(engine)


def browse_rollout(url: str) -> RolloutConfig:
    call = {"name": "browse", "arguments": {"url": url}}
    return RolloutConfig(protocol="chat_tools", max_turns=2, max_response_tokens=400, max_tokens_per_turn=24,
                         assistant_prefix=f"<tool_call>\n{json.dumps(call)}\n</tool_call>",
                         logit_bias={"<|im_end|>": 8.0})


class BrowseRun:
    """The policy engine with the browse tool over the frozen summariser, its tool store under ``store``."""

    def __init__(self, bench, tools: ToolsConfig, url: str, model_dir) -> None:
        self.bench, self.url = bench, url
        self.registry = build_registry(tools, RetrieverConfig(), "")
        self.protocol = make_protocol("chat_tools", self.registry.specs, tokenizer=str(model_dir))
        self.loop = AgentLoop(bench.engine, self.protocol, self.registry, browse_rollout(url), seed=1)

    def rollout(self, items, step: int):
        return self.bench.events.run(self.loop.run(items, step))


@pytest.fixture(scope="module")
def recorded(engine_bench, summariser_engine, site, tiny_model_dir, toy_data, tmp_path_factory):
    """Step 1's rollout with the tool store recording, and the run that made it."""
    tools, _ = summariser_engine
    store = tmp_path_factory.mktemp("tool_store")
    run = BrowseRun(engine_bench, dataclasses.replace(tools, cache_dir=str(store)), site, tiny_model_dir)
    items = prompt_items(toy_data, prompts=2, samples=4)
    yield run, items, run.rollout(items, 1), store
    run.registry.close()


def expected_summary(engine, question: str, url: str) -> str:
    prompt = PromptFile.load("", SUMMARY_PROMPT, (), "").render(question=question, query=url,
                                                               page=f"{PAGE_TITLE}\n{PAGE_TEXT}")
    return ray.get(engine.complete.remote([prompt], SUMMARY_TOKENS))[0]


def test_browse_agent_observations_are_the_frozen_summariser_text_masked_and_replayed(
        recorded, summariser_engine, engine_bench, tiny_model_dir):
    run, items, trajectories, store = recorded
    tools, engine = summariser_engine
    recorded_calls = ray.get(engine.stats.remote())["calls"]
    questions = {item.example_id: item.question for item in items}
    summaries = {example: expected_summary(engine, question, run.url) for example, question in questions.items()}
    for trajectory in trajectories:
        first = trajectory.turns[0]
        assert [(call.name, call.ok) for call in first.tool_calls] == [("browse", True)]
        summary = summaries[trajectory.example_id]
        assert summary.strip() and first.tool_outputs == [
            run.protocol.observation([Document(summary, PAGE_TITLE, run.url, kind="webpage")])]
        assert "RAWPAGE" not in first.observation  # the policy saw the summary, not the page
        assert assert_masks_follow_turns(trajectory, engine_bench.engine.tokenizer) >= 1
    # every call not answered by the store (a sample behind an identical call) read its page through the
    # summariser, counted where tool calls are
    live = sum(not t.turns[0].tool_calls[0].cached for t in trajectories)
    assert run.registry.stats()["summariser_calls"] == live == recorded_calls >= len(questions)

    replay_tools = dataclasses.replace(tools, replay=True, cache_dir=str(store))
    replay = BrowseRun(engine_bench, replay_tools, run.url, tiny_model_dir)
    try:
        again = replay.rollout(items, 1)
    finally:
        replay.registry.close()
    assert [t.token_ids for t in again] == [t.token_ids for t in trajectories]
    assert [t.loss_mask for t in again] == [t.loss_mask for t in trajectories]
    assert replay.registry.calls_out == 0 and all(call.cached for t in again for call in t.turns[0].tool_calls)
    assert ray.get(engine.stats.remote())["calls"] == recorded_calls + len(summaries)  # ours: not asked again


def _samples(trajectories) -> list[TrainSample]:
    rewards = torch.tensor([float(t.sample_index in (0, 3)) for t in trajectories])  # synthetic, varied in a group
    advantages = grpo_advantages(rewards, [t.group_id for t in trajectories])
    weights = loss_token_weights([t.loss_mask for t in trajectories], "token_mean")
    return [TrainSample(t.token_ids, len(t.prompt_ids), t.loss_mask, float(a), w, rollout_logprobs=t.rollout_logprobs)
            for t, a, w in zip(trajectories, advantages, weights)]


def test_a_run_whose_browse_summarises_through_a_frozen_engine_trains_two_steps(
        recorded, actor_ranks, engine_bench, summariser_engine, tiny_model_dir, toy_data):
    from safetensors.torch import load_file

    run, items, trajectories, _ = recorded
    step_two_items = [dataclasses.replace(item, group_id=item.group_id - 2)
                      for item in prompt_items(toy_data, prompts=4, samples=4)[len(items):]]
    _, engine = summariser_engine
    frozen_calls = ray.get(engine.stats.remote())["calls"]
    start = actor_ranks.hf_state_dict()
    try:
        for step in (1, 2):
            if step == 2:  # new questions, with the weights step 1 trained
                trajectories = run.rollout(step_two_items, 2)
                assert all(t.turns[0].tool_calls[0].ok for t in trajectories)
                assert all("RAWPAGE" not in t.turns[0].observation for t in trajectories)
            metrics = actor_ranks.train_step(_samples(trajectories))
            assert metrics["actor/update_ok"] == 1.0 and metrics["actor/grad_norm"] > 0
            engine_bench.load_weights(actor_ranks.hf_state_dict())  # the policy engine follows the actor
        trained = actor_ranks.hf_state_dict()
        assert any(not torch.equal(start[name], trained[name]) for name in start)
        # step 2's questions were read through the frozen engine (never synced: it is not the policy)
        live = sum(not t.turns[0].tool_calls[0].cached for t in trajectories)
        assert ray.get(engine.stats.remote())["calls"] == frozen_calls + live >= frozen_calls + 2
    finally:
        engine_bench.load_weights(load_file(f"{tiny_model_dir}/model.safetensors"))


def test_a_summary_past_its_timeout_ends_in_the_engine_too_and_the_engine_answers_the_next(summariser_engine):
    """The driver giving up on a summary (tools.browse.summariser.timeout_s) leaves nothing running: the frozen engine
    ends the call itself at that timeout, its requests aborted, and answers the next call as before."""
    from rlsearch.tools import ToolError
    from rlsearch.tools.clients.summarise import EngineSummariser

    tools, engine = summariser_engine
    calls = ray.get(engine.stats.remote())["calls"]
    with pytest.raises(TimeoutError):  # a RayTaskError of the engine's own TimeoutError
        ray.get(engine.complete.remote(["Summarise the page."], SUMMARY_TOKENS, 0.001), timeout=60)
    summariser = EngineSummariser(tools.browse.summariser.engine_actor, SUMMARY_TOKENS, timeout_s=0.001)
    with pytest.raises(ToolError, match="the frozen engine took longer than 0.001 s"):
        summariser.summarise("Summarise the page.")
    (summary,) = ray.get(engine.complete.remote(["Summarise the page."], SUMMARY_TOKENS, 60.0), timeout=60)
    assert summary.strip() and ray.get(engine.stats.remote())["calls"] == calls + 1
