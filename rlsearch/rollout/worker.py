"""A rollout worker: one vLLM engine, the agent loop and the tool clients. Runs as a Ray actor."""

from __future__ import annotations

from collections.abc import Sequence

from ..bridge.bucket import WeightBucket
from ..config import RetrieverConfig, RolloutConfig, ToolsConfig
from ..tools import build_registry, make_protocol
from .agent_loop import AgentLoop, PromptItem
from .engine import EngineSpec, VLLMEngine
from .trajectory import Trajectory


class RolloutWorker:
    """``retriever`` and ``retriever_url`` set up the ``search`` tool's client; ``tools`` says which tools the
    agent gets (built-in names, MCP servers with their URLs, web tools, the result cache); None: search only."""

    def __init__(
        self, engine_spec: EngineSpec, rollout: RolloutConfig, retriever: RetrieverConfig, retriever_url: str,
        seed: int, tools: ToolsConfig | None = None,
    ) -> None:
        # tools first: a bad tool set-up fails in a second, before the engine spends its start-up time
        self.tools = build_registry(tools or ToolsConfig(), retriever, retriever_url)
        try:
            protocol = make_protocol(rollout.protocol, self.tools.specs, rollout.prompt_file)
            self.engine = VLLMEngine(engine_spec)
        except BaseException:
            self.tools.close()
            raise
        self.loop = AgentLoop(self.engine, protocol, self.tools, rollout, seed)

    def generate(self, items: Sequence[PromptItem], step: int) -> list[Trajectory]:
        return self.loop.run(items, step)

    def tool_stats(self) -> dict[str, int]:
        """Requests, retries and failures summed over the tools that count them."""
        return self.tools.stats()

    def probe_sequence(self, question: str, continuation: str) -> list[int]:
        """A fixed sequence for engine-vs-actor checks: a real prompt followed by a fixed continuation."""
        return self.loop.prompt_ids(question) + self.engine.tokenizer.encode(continuation, add_special_tokens=False)

    def score(self, token_ids: list[int]) -> list[float]:
        return self.engine.score(token_ids)

    def begin_weight_update(self) -> None:
        self.engine.begin_weight_update()

    def load_weight_bucket(self, bucket: WeightBucket) -> tuple[int, int]:
        return self.engine.load_weight_bucket(bucket)

    def finish_weight_update(self) -> None:
        self.engine.finish_weight_update()

    def shutdown(self) -> None:
        self.tools.close()
