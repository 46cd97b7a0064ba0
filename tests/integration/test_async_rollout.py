"""The per-sample and the turn-barrier agent loop on one real vLLM AsyncLLM engine and the real BM25 server.

Both loops share every per-turn step and per-request seeds, so they must give the same trajectories, sampled
(the random tiny model, the tool path forced by prefill and logit bias) and greedy. A random model never opens a
second search by itself (and greedy decoding never closes its first), so the greedy and scheduling tests load,
through the engine's weight-sync path, the tiny model rewired into a policy that writes
``<search> born</search>`` every turn (`search_automaton_weights`).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import fastapi
import httpx
import pytest
from safetensors.torch import load_file

from rlsearch.config import RetrieverConfig, RolloutConfig, ToolsConfig
from rlsearch.data import load_qa_dataset
from rlsearch.data.tiny_model import search_automaton_weights
from rlsearch.loop_thread import LoopThread
from rlsearch.rollout import AgentLoop, EngineSpec, PromptItem, Trajectory, VLLMEngine
from rlsearch.tools import build_registry, make_protocol
from rlsearch.weights.bucket import pack_bucket
from tests.constants import TEST_KV_CACHE_GIB, TEST_ROLLOUT
from tests.integration.threaded_server import serve_in_thread

AUTOMATON_QUERY = " born"
AUTOMATON_ROLLOUT = {**TEST_ROLLOUT, "max_response_tokens": 512, "logit_bias": {}}


class Engine:
    """One AsyncLLM engine on its event loop thread, as a rollout worker holds it, with switchable weights."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.events = LoopThread("test-engine")

        async def start() -> VLLMEngine:
            return VLLMEngine(EngineSpec(str(model_dir), kv_cache_gib=TEST_KV_CACHE_GIB, max_model_len=768))

        self.engine = self.events.run(start())
        self.weights = "random"

    def use_weights(self, weights: str) -> None:
        """``random`` (the tiny model as built), ``automaton`` or ``rescaled``, loaded by the weight-sync path if not
        loaded."""
        if weights != self.weights:
            self.events.run(self.load_weights(weights))

    async def load_weights(self, weights: str) -> None:
        """The weight-sync path of a rollout worker, on the engine's loop (requests may be in flight)."""
        state = load_file(str(self.model_dir / "model.safetensors"))
        if weights == "automaton":
            state = search_automaton_weights(state, self.engine.tokenizer, [AUTOMATON_QUERY])
        elif weights == "rescaled":  # another policy whose attention reads a different KV cache
            state = {name: tensor * 2.0 if name.endswith(("k_proj.weight", "v_proj.weight")) else tensor
                     for name, tensor in state.items()}
        await self.engine.weights.begin()
        payload = sum(t.numel() * t.element_size() for t in state.values())
        # (tensors, payload bytes, bytes received): a whole bucket's bytes are its payload
        assert await self.engine.weights.load_bucket(pack_bucket(list(state.items()))) == (len(state), payload, payload)
        await self.engine.weights.finish()
        self.weights = weights

    def rollout(self, retriever_url: str, items: list[PromptItem], step: int, **rollout) -> list[Trajectory]:
        tools = build_registry(ToolsConfig(), RetrieverConfig(topk=2, timeout_s=300.0, max_retries=0), retriever_url)
        try:
            protocol = make_protocol("search_r1", tools.specs)
            loop = AgentLoop(self.engine, protocol, tools, RolloutConfig(**rollout), seed=1)
            return self.events.run(loop.run(items, step))
        finally:
            tools.close()

    def close(self) -> None:
        self.events.run(self.engine.shutdown())
        self.events.stop()


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = Engine(Path(tiny_model_dir))
    yield engine
    engine.close()


def prompt_items(toy_data, prompts: int = 4, samples: int = 2) -> list[PromptItem]:
    examples = load_qa_dataset(toy_data.train)[:prompts]
    return [PromptItem(e.id, e.question, group_id=i, sample_index=s) for i, e in enumerate(examples)
            for s in range(samples)]


def assert_same_trajectories(first: list[Trajectory], second: list[Trajectory]) -> None:
    assert len(first) == len(second)
    for a, b in zip(first, second):
        assert (a.group_id, a.sample_index, a.prompt_ids) == (b.group_id, b.sample_index, b.prompt_ids)
        assert a.response_ids == b.response_ids
        assert a.loss_mask == b.loss_mask
        # the two loops batch requests differently, so float32 sums may reorder: a few ulps of a logprob near -12
        # (1 ulp = 9.5e-7), while a different sampled token would differ by far more
        assert max((abs(x - y) for x, y in zip(a.rollout_logprobs, b.rollout_logprobs, strict=True)), default=0) <= 1e-5
        assert a.finish_reason == b.finish_reason
        assert [turn_record(t) for t in a.turns] == [turn_record(t) for t in b.turns]


def turn_record(turn) -> tuple:
    return (turn.text, turn.num_tokens, turn.kind, turn.observation, turn.error_kind,
            [(call.name, call.query, call.ok, call.error) for call in turn.tool_calls])


@pytest.mark.parametrize("weights,temperature", [("random", 1.0), ("automaton", 0.0)], ids=["sampled", "greedy"])
def test_per_sample_and_turn_barrier_loops_give_identical_trajectories(
    engine, retriever, toy_data, weights, temperature
):
    engine.use_weights(weights)
    rollout = {**(TEST_ROLLOUT if weights == "random" else AUTOMATON_ROLLOUT), "temperature": temperature}
    items = prompt_items(toy_data)
    per_sample = engine.rollout(retriever.url, items, 1, agent_loop="per_sample", **rollout)
    turn_barrier = engine.rollout(retriever.url, items, 1, agent_loop="turn_barrier", **rollout)

    searched = [t for t in per_sample if t.dispatched_calls]
    assert searched and all(call.ok for t in searched for call in t.dispatched_calls)
    observations = [turn.observation for t in searched for turn in t.turns if turn.tool_calls and turn.observation]
    assert all(o.startswith("\n\n<information>") and "Error:" not in o for o in observations)
    assert max(len(t.turns) for t in per_sample) >= 2
    if weights == "automaton":
        # a search in every turn; the last turn's is not run (max_turns)
        assert all(t.finish_reason == "max_turns" and len(t.tool_calls) == 3 for t in per_sample)
    assert_same_trajectories(per_sample, turn_barrier)
    for trajectory in per_sample + turn_barrier:
        assert trajectory.generate_s > 0.0
        assert (trajectory.tool_s > 0.0) == any(call.latency_s > 0.0 for call in trajectory.tool_calls)
        assert {"generate_s", "tool_s"} <= set(trajectory.to_json())


class HoldFirstRequest:
    """A retrieval server in front of the real one. The first request is held until ``release_after`` queries of
    later requests have arrived (or ``hold_s`` passed); ``arrived_while_held`` counts those queries."""

    def __init__(self, retriever_url: str, release_after: int, hold_s: float) -> None:
        self.retriever_url = retriever_url
        self.release_after = release_after
        self.hold_s = hold_s
        self.held_queries = 0
        self.arrived_while_held = 0
        self.holding = False
        self._release: asyncio.Event | None = None

    def app(self) -> fastapi.FastAPI:
        app = fastapi.FastAPI()

        @app.post("/retrieve")
        async def retrieve(request: fastapi.Request) -> fastapi.Response:
            body = await request.json()
            if self._release is None:  # the first request
                self._release, self.holding, self.held_queries = asyncio.Event(), True, len(body["queries"])
                try:
                    await asyncio.wait_for(self._release.wait(), self.hold_s)
                except TimeoutError:
                    pass
                self.holding = False
            elif self.holding:
                self.arrived_while_held += len(body["queries"])
                if self.arrived_while_held >= self.release_after:
                    self._release.set()
            async with httpx.AsyncClient(timeout=60.0) as client:
                answer = await client.post(f"{self.retriever_url}/retrieve", json=body)
            return fastapi.Response(answer.content, status_code=answer.status_code, media_type="application/json")

        return app


def test_a_sample_waiting_on_a_slow_search_does_not_hold_the_others(engine, retriever, toy_data):
    """Every automaton trajectory searches in its first turn and again in its second. With the first search to reach
    the server held back, more than the other trajectories' first searches arriving meanwhile means some other
    trajectory generated its second turn while that search was pending. The turn barrier never lets that happen."""
    engine.use_weights("automaton")
    items = prompt_items(toy_data)
    reference = engine.rollout(retriever.url, items, 1, agent_loop="per_sample", **AUTOMATON_ROLLOUT)
    others_first_searches = len(items) - 1

    # released as soon as one second-turn search of another trajectory arrives (a fallback bound, no threshold)
    per_sample_server = HoldFirstRequest(retriever.url, release_after=others_first_searches + 1, hold_s=300.0)
    with serve_in_thread(per_sample_server.app()) as url:
        started = time.monotonic()
        per_sample = engine.rollout(url, items, 1, agent_loop="per_sample", **AUTOMATON_ROLLOUT)
    assert per_sample_server.held_queries == 1
    assert per_sample_server.arrived_while_held > others_first_searches, (
        f"no other trajectory got past its first turn in {time.monotonic() - started:.0f} s while one search was held"
    )

    turn_barrier_server = HoldFirstRequest(retriever.url, release_after=1, hold_s=3.0)
    with serve_in_thread(turn_barrier_server.app()) as url:
        turn_barrier = engine.rollout(url, items, 1, agent_loop="turn_barrier", **AUTOMATON_ROLLOUT)
    # the first turn's searches travel as one request, and nothing else arrives until it is answered
    assert turn_barrier_server.held_queries == len(items)
    assert turn_barrier_server.arrived_while_held == 0
    assert_same_trajectories(per_sample, reference)
    assert_same_trajectories(turn_barrier, reference)


def test_a_weight_update_lands_on_requests_in_flight(engine):
    """Requests streaming from the random weights get other weights mid-generation (key and value projections
    doubled): each one's sampled logprobs equal the old policy's (teacher-forced by the engine) up to some token and
    the new policy's from there on. Matching the new policy after the switch needs the running requests' KV cache
    recomputed with the new weights."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine.use_weights("random")
    prompt = engine.engine.tokenizer.encode("Who founded the town of Ashford?")
    min_tokens_before_update = 40

    async def generate_across_update() -> list[list[tuple[int, float]]]:
        progress = [0, 0, 0]
        started = asyncio.Event()

        async def stream(index: int) -> list[tuple[int, float]]:
            params = SamplingParams(max_tokens=500, ignore_eos=True, temperature=1.0, logprobs=0, seed=index)
            final = None
            async for output in engine.engine.llm.generate(TokensPrompt(prompt_token_ids=list(prompt)), params,
                                                            request_id=f"in-flight-{index}"):
                final = output.outputs[0]
                progress[index] = len(final.token_ids)
                if min(progress) >= min_tokens_before_update:
                    started.set()
            return [(token, entry[token].logprob) for token, entry in zip(final.token_ids, final.logprobs)]

        streams = [asyncio.ensure_future(stream(index)) for index in range(3)]
        await asyncio.wait_for(started.wait(), 120)
        version = engine.engine.weight_version
        await engine.load_weights("rescaled")
        assert engine.engine.weight_version == version + 1
        assert not all(stream.done() for stream in streams), "the requests finished before the weight update"
        return await asyncio.gather(*streams)

    sampled = engine.events.run(generate_across_update())
    sequences = [prompt + [token for token, _ in tokens] for tokens in sampled]
    new_policy = [engine.events.run(engine.engine.score(ids)) for ids in sequences]
    engine.use_weights("random")
    old_policy = [engine.events.run(engine.engine.score(ids)) for ids in sequences]

    for tokens, old, new in zip(sampled, old_policy, new_policy):
        logprobs = [logprob for _, logprob in tokens]
        old, new = old[len(prompt) - 1:], new[len(prompt) - 1:]
        switch = next(i for i, (lp, o) in enumerate(zip(logprobs, old)) if abs(lp - o) > 1e-4)
        assert min_tokens_before_update <= switch < len(logprobs)
        assert max(abs(lp - n) for lp, n in zip(logprobs[switch:], new[switch:])) < 1e-4
        assert max(abs(o - n) for o, n in zip(old[switch:], new[switch:])) > 0.1  # the two policies do differ
