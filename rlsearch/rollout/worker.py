"""A rollout worker: one vLLM engine, the agent loop and the tool clients. Runs as a Ray actor."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config import RetrieverConfig, RolloutConfig
from ..tools import RetrievalClient, SearchR1Protocol
from .agent_loop import AgentLoop, PromptItem
from .engine import EngineSpec, VLLMEngine
from .trajectory import Trajectory

PROTOCOLS = {"search_r1": SearchR1Protocol}


class RolloutWorker:
    def __init__(
        self, engine_spec: EngineSpec, rollout: RolloutConfig, retriever: RetrieverConfig, retriever_url: str,
        seed: int,
    ) -> None:
        self.engine = VLLMEngine(engine_spec)
        self.client = RetrievalClient(
            retriever_url, topk=retriever.topk, timeout_s=retriever.timeout_s, max_retries=retriever.max_retries,
            backoff_s=retriever.backoff_s,
        )
        self.loop = AgentLoop(self.engine, PROTOCOLS[rollout.protocol](), self.client.retrieve, rollout, seed)

    def generate(self, items: Sequence[PromptItem], step: int) -> list[Trajectory]:
        return self.loop.run(items, step)

    def tool_stats(self) -> dict[str, int]:
        return {
            "requests": self.client.num_requests,
            "retries": self.client.num_retries,
            "failures": self.client.num_failures,
        }

    def probe_sequence(self, question: str, continuation: str) -> list[int]:
        """A fixed sequence for engine-vs-actor checks: a real prompt followed by a fixed continuation."""
        return self.loop.prompt_ids(question) + self.engine.tokenizer.encode(continuation, add_special_tokens=False)

    def score(self, token_ids: list[int]) -> list[float]:
        return self.engine.score(token_ids)

    def begin_weight_update(self) -> None:
        self.engine.begin_weight_update()

    def load_weight_bucket(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        return self.engine.load_weight_bucket(named_tensors)

    def finish_weight_update(self) -> None:
        self.engine.finish_weight_update()

    def shutdown(self) -> None:
        self.client.close()
