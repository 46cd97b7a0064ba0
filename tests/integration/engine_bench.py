"""One real vLLM engine on its event loop, as a rollout worker holds it, with the tools, the built-in loop and user
agents at any rollout settings: the session's `engine_bench` fixture (tests/conftest.py) shares it."""

from __future__ import annotations

from pathlib import Path

from rlsearch.config import RetrieverConfig, RolloutConfig, ToolsConfig
from rlsearch.data import load_qa_dataset
from rlsearch.loop_thread import LoopThread
from rlsearch.rollout import AgentLoop, EngineSpec, PromptItem, VLLMEngine
from rlsearch.rollout.session import AgentRunner, SessionEndpoint
from rlsearch.tools import build_registry, make_protocol
from rlsearch.weights.bucket import pack_bucket
from tests.constants import TEST_KV_CACHE_GIB, TEST_ROLLOUT

AUTOMATON_QUERIES = [" born", " river"]  # the search automaton's queries (single tokens), the first its greedy choice


class Bench:
    """The engine, the search tool over the real BM25 server, the search_r1 protocol; ``builtin`` and ``agent`` run
    prompts with TEST_ROLLOUT updated by the given rollout keys."""

    def __init__(self, model_dir: Path, retriever_url: str) -> None:
        self.events = LoopThread("test-engine")

        async def start() -> VLLMEngine:
            # a 4k window: test_long_horizon
            return VLLMEngine(EngineSpec(str(model_dir), kv_cache_gib=TEST_KV_CACHE_GIB, max_model_len=4096))

        self.engine = self.events.run(start())
        self.tools = build_registry(ToolsConfig(), RetrieverConfig(topk=2, timeout_s=300.0, max_retries=0),
                                    retriever_url)
        self.protocol = make_protocol("search_r1", self.tools.specs)

    def loop(self, **rollout) -> AgentLoop:
        return AgentLoop(self.engine, self.protocol, self.tools, RolloutConfig(**{**TEST_ROLLOUT, **rollout}), seed=1)

    def builtin(self, items, step: int, **rollout):
        return self.events.run(self.loop(**rollout).run(items, step))

    def agent(self, agent, items, step: int, **rollout):
        loop = self.loop(**rollout)
        endpoint = SessionEndpoint(self.engine, self.tools, loop.config, seed=1, logit_bias=loop.logit_bias)
        runner = AgentRunner(endpoint, agent, loop.prompt_messages, loop.config)
        try:
            return self.events.run(runner.run(items, step))
        finally:
            self.events.run(endpoint.stop())
            runner.stop()

    def load_weights(self, state: dict) -> None:
        """An HF state dict into the engine through its weight receiver (one object-store-style bucket)."""

        async def load() -> None:
            await self.engine.weights.begin()
            await self.engine.weights.load_bucket(pack_bucket(list(state.items())))
            await self.engine.weights.finish()

        self.events.run(load())

    def close(self) -> None:
        self.tools.close()
        self.events.run(self.engine.shutdown())
        self.events.stop()


def prompt_items(toy_data, prompts: int = 4, samples: int = 2) -> list[PromptItem]:
    examples = load_qa_dataset(toy_data.train)[:prompts]
    return [PromptItem(e.id, e.question, group_id=i, sample_index=s, data_source=e.data_source,
                       golden_answers=tuple(e.golden_answers)) for i, e in enumerate(examples) for s in range(samples)]


def sampled_runs(segment) -> list[list[int]]:
    """A segment's runs of loss-mask-1 tokens, in order: one per model call (turn)."""
    runs: list[list[int]] = []
    previous = 0
    for token, mask in zip(segment.response_ids, segment.loss_mask):
        if mask and not previous:
            runs.append([])
        if mask:
            runs[-1].append(token)
        previous = mask
    return runs
