"""User agents as plain Python on the `openai` client, through the rollout worker's session endpoint, on a real vLLM
engine and the real BM25 server over HTTP.

The Search-R1 agent of examples/agents must sample exactly the built-in loop's tokens (same per-call seeds, same
engine); an agent that rewrites its history gets two segments; chat calls that extend each other continue from
the sampled ids, with the template's seam after `<|im_end|>` as a loss-mask-0 token; bad requests get 4xx.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from examples.agents.search_r1 import agent as search_r1_agent
from rlsearch.config import AlgoConfig
from rlsearch.tools import ToolCall
from rlsearch.trainer.step_batch import train_samples
from tests.integration.engine_bench import prompt_items

LOGPROB_TOLERANCE = 1e-5  # two batchings of one engine may reorder float32 sums: a few ulps, never another token


@pytest.fixture
def bench(engine_bench):
    return engine_bench


def test_search_r1_agent_workflow_samples_the_builtin_loops_tokens(bench, toy_data):
    items = prompt_items(toy_data)
    builtin = bench.builtin(items, step=3)
    agents = bench.agent(search_r1_agent, items, step=3)
    observation_tokens = 0
    for ours, theirs in zip(agents, builtin, strict=True):
        assert not ours.failed
        assert ours.earlier_segments == []
        assert ours.prompt_ids == theirs.prompt_ids
        assert ours.response_ids == theirs.response_ids
        assert ours.loss_mask == theirs.loss_mask
        diffs = [abs(x - y) for x, y in zip(ours.rollout_logprobs, theirs.rollout_logprobs, strict=True)]
        assert max(diffs, default=0.0) <= LOGPROB_TOLERANCE
        assert len(ours.turns) == len(theirs.turns)
        observation_tokens += ours.loss_mask.count(0)
    # the comparison covers the tool path: searches ran and their results were appended (mask 0) in both
    assert observation_tokens > 0
    assert sum(len(t.tool_calls) for t in agents) == sum(len(t.tool_calls) for t in builtin) > 0


def rewriting_agent(records: dict):
    """Two chat calls: the second drops the first's answer and asks afresh (a history rewrite)."""

    async def agent(session, example) -> float:
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0) as client:
            return await ask_twice(client, session, example)

    async def ask_twice(client, session, example) -> float:
        question = [{"role": "user", "content": example.question}]
        first = await client.chat.completions.create(model=session.model, messages=question, max_tokens=8)
        second = await client.chat.completions.create(
            model=session.model, messages=[{"role": "user", "content": "Answer briefly: " + example.question}],
            max_tokens=8,
        )
        records[example.group_id, example.sample_index] = [first.model_extra, second.model_extra,
                                                           first.choices[0].model_extra, second.choices[0].model_extra]
        return 0.5

    return agent


def test_an_agent_that_rewrites_its_history_gets_two_segments_of_what_was_sampled(bench, toy_data):
    records: dict = {}
    items = prompt_items(toy_data, prompts=2, samples=1)
    trajectories = bench.agent(rewriting_agent(records), items, step=1)
    for trajectory in trajectories:
        first, second, first_choice, second_choice = records[trajectory.group_id, trajectory.sample_index]
        assert not trajectory.failed
        assert len(trajectory.segments) == 2
        for segment, response, choice in [(trajectory.segments[0], first, first_choice),
                                          (trajectory.segments[1], second, second_choice)]:
            assert segment.prompt_ids == response["prompt_token_ids"]
            assert segment.response_ids == choice["token_ids"]
            assert segment.loss_mask == [1] * len(choice["token_ids"])
        assert trajectory.agent_reward == 0.5
    # every segment trains with its trajectory's advantage: one group, rewards 1 and 0
    winner, loser = trajectories
    loser.group_id = winner.group_id
    winner.reward, loser.reward = 1.0, 0.0
    samples = train_samples(trajectories, AlgoConfig())
    segments = [segment for trajectory in trajectories for segment in trajectory.segments]
    assert [s.token_ids for s in samples] == [segment.prompt_ids + segment.response_ids for segment in segments]
    advantages = [s.advantage for s in samples]
    assert advantages[0] == advantages[1] > 0 > advantages[2] == advantages[3]


def chat_agent(records: dict):
    """A chat agent in the native tool format: it answers the model's turn with a tool message and asks again."""

    async def agent(session, example) -> None:
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0) as client:
            messages = [{"role": "user", "content": example.question}]
            first = await client.chat.completions.create(model=session.model, messages=messages, max_tokens=6)
            messages.append(first.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "content": "Doc 1: the answer is in here"})
            second = await client.chat.completions.create(model=session.model, messages=messages, max_tokens=6)
            messages.append(second.choices[0].message.model_dump(exclude_none=True))
            records[example.group_id] = (messages, first, second)

    return agent


def test_chat_calls_that_extend_each_other_continue_from_the_sampled_ids(bench, toy_data):
    records: dict = {}
    tokenizer = bench.engine.tokenizer
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    # a bias towards <|im_end|> makes some first turns end the assistant turn, others run out of tokens
    trajectories = bench.agent(chat_agent(records), prompt_items(toy_data, prompts=4, samples=1), step=2,
                               logit_bias={"<|im_end|>": 9.0}, assistant_prefix="")
    endings = set()
    for trajectory in trajectories:
        messages, first, second = records[trajectory.group_id]
        assert not trajectory.failed and len(trajectory.segments) == 1
        first_ids, second_ids = first.choices[0].model_extra["token_ids"], second.choices[0].model_extra["token_ids"]
        prompt = first.model_extra["prompt_token_ids"]
        assert trajectory.prompt_ids == prompt
        # the second call's prompt is the first prompt, the sampled ids as sampled, then the inserted tokens
        assert second.model_extra["prompt_token_ids"][: len(prompt) + len(first_ids)] == prompt + first_ids
        assert trajectory.token_ids == second.model_extra["prompt_token_ids"] + second_ids
        inserted = len(second.model_extra["prompt_token_ids"]) - len(prompt) - len(first_ids)
        assert trajectory.loss_mask == [1] * len(first_ids) + [0] * inserted + [1] * len(second_ids)
        # the inserted text is what a full re-render puts between the first turn's text and the second's
        ended = first_ids[-1] == end_of_turn
        endings.add(ended)
        inserted_text = tokenizer.decode(trajectory.response_ids[len(first_ids): len(first_ids) + inserted])
        full = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        first_text = tokenizer.decode(first_ids[:-1] if ended else first_ids)
        assert inserted_text == full[full.index(first_text) + len(first_text):].removeprefix("<|im_end|>" if ended
                                                                                          else "")
        # the seam: the newline the template writes after <|im_end|> is an inserted (mask 0) token
        assert inserted_text.startswith("\n<|im_start|>user\n<tool_response>" if ended
                                        else "<|im_end|>\n<|im_start|>user\n<tool_response>")
    assert endings == {True, False}  # both seams were exercised


def test_bad_requests_get_4xx_and_failing_agents_fail_only_their_trajectory(bench, toy_data):
    seen: dict = {}

    async def agent(session, example):
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key="unused", max_retries=0) as client:
            if example.group_id == 0:
                raise RuntimeError("agent bug")
            if example.group_id == 1:
                await asyncio.sleep(30)
            user = [{"role": "user", "content": example.question}]
            unknown = openai.AsyncOpenAI(base_url=session.base_url.replace(session.id, "nope"), api_key="x",
                                         max_retries=0)
            async with unknown:
                with pytest.raises(openai.NotFoundError) as missing:
                    await unknown.chat.completions.create(model=session.model, messages=user)
            seen["404"] = missing.value.message
            with pytest.raises(openai.BadRequestError) as streaming:
                await client.chat.completions.create(model=session.model, messages=user, stream=True)
            seen["stream"] = streaming.value.message
            with pytest.raises(openai.BadRequestError) as distribution:
                await client.chat.completions.create(model=session.model, messages=user, temperature=0.5,
                                                     extra_body={"top_k": 5})
            seen["distribution"] = distribution.value.message
            models = await client.models.list()
            seen["models"] = [model.id for model in models.data]
            first = await client.completions.create(model=session.model, prompt=example.question, max_tokens=200)
            with pytest.raises(openai.BadRequestError) as budget:  # the first call used the whole response budget
                await client.completions.create(
                    model=session.model, prompt=example.question + first.choices[0].text + "!", max_tokens=4
                )
            seen["budget"] = budget.value.message
            return "an answer"

    trajectories = bench.agent(agent, prompt_items(toy_data, prompts=3, samples=1), step=1,
                               agent_timeout_s=6.0, max_response_tokens=16)
    failed, timed_out, fine = trajectories
    assert failed.failed == "the agent raised RuntimeError: agent bug"
    assert "rollout.agent_timeout_s=6.0" in timed_out.failed
    assert not fine.failed and fine.agent_answer == "an answer" and fine.finish_reason == "length"
    assert "no agent session" in seen["404"]
    assert "streaming is not supported" in seen["stream"]
    assert "asks for another: temperature=0.5 (rollout.temperature is 1.0), top_k=5" in seen["distribution"]
    assert seen["models"] == ["rlsearch-policy"]
    assert "rollout.max_response_tokens=16" in seen["budget"]
    # failed trajectories are left out of training (and of their group's statistics)
    assert len(train_samples(trajectories, AlgoConfig())) == 1


PREFILLED_CALLS = (
    '<tool_call>\n{"name": "search", "arguments": {"query": "QUERY"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "search", "arguments": {"query": "QUERY", "topk": 1}}\n</tool_call>'
)


def native_tool_agent(records: dict):
    """Native tool calls through the endpoint: the first turn's two calls are prefilled (a random model never writes
    them), the endpoint returns them as OpenAI tool_calls, both run concurrently, and their results go back as tool
    messages for a second turn."""

    async def agent(session, example) -> None:
        client, tools = session.openai(), session.tools.openai_schemas()
        messages = [{"role": "user", "content": example.question}]
        calls = PREFILLED_CALLS.replace("QUERY", example.question)
        first = await client.chat.completions.create(
            model=session.model, messages=[*messages, {"role": "assistant", "content": calls}], tools=tools,
            max_tokens=4, extra_body={"continue_final_message": True, "add_generation_prompt": False},
        )
        reply = first.choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        results = await session.tools.run([
            ToolCall(call.function.name, "", arguments=json.loads(call.function.arguments)) for call in reply.tool_calls
        ])
        for call, result in zip(reply.tool_calls, results):
            content = "\n".join(document.text for document in result.documents)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
        second = await client.chat.completions.create(model=session.model, messages=messages, tools=tools, max_tokens=6)
        records[example.group_id] = (messages, first, second, results)

    return agent


def test_native_tool_calls_come_back_as_tool_calls_and_their_results_continue_the_sampled_ids(bench, toy_data):
    records: dict = {}
    tokenizer = bench.engine.tokenizer
    trajectories = bench.agent(native_tool_agent(records), prompt_items(toy_data, prompts=4, samples=1), step=4,
                               logit_bias={"<|im_end|>": 9.0}, assistant_prefix="")
    for trajectory in trajectories:
        messages, first, second, results = records[trajectory.group_id]
        assert not trajectory.failed and len(trajectory.segments) == 1
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
            ("search", {"query": messages[0]["content"]}), ("search", {"query": messages[0]["content"], "topk": 1})
        ]
        assert [len(result.documents) for result in results] == [2, 1]  # tools.retriever.topk, then the typed topk
        records_of_turn = trajectory.turns[0].tool_calls
        assert [record.arguments for record in records_of_turn] == [json.loads(c.function.arguments)
                                                                    for c in choice.message.tool_calls]
        assert all(record.ok for record in records_of_turn)
        first_ids = choice.model_extra["token_ids"]
        prompt = first.model_extra["prompt_token_ids"]
        second_prompt = second.model_extra["prompt_token_ids"]
        assert second_prompt[: len(prompt) + len(first_ids)] == prompt + first_ids
        inserted = second_prompt[len(prompt) + len(first_ids):]
        assert trajectory.loss_mask == [1] * len(first_ids) + [0] * len(inserted) + [1] * len(
            second.choices[0].model_extra["token_ids"])
        ended = first_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
        tool_turn = "".join(f"\n<tool_response>\n{m['content']}\n</tool_response>" for m in messages[2:])
        seam = "\n" if ended else "<|im_end|>\n"
        assert tokenizer.decode(inserted) == f"{seam}<|im_start|>user{tool_turn}<|im_end|>\n<|im_start|>assistant\n"
