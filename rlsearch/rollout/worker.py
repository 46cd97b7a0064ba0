"""A rollout worker: one vLLM engine, the agent loop and the tool clients. Runs as a Ray actor or in-process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from concurrent.futures import Future, wait
from contextlib import contextmanager
from typing import Any, TypeVar

from ..config import RetrieverConfig, RolloutConfig, ToolsConfig
from ..loop_thread import LoopThread
from ..runlog import redirect_worker_output
from ..tools import ToolProtocol, ToolRegistry, build_registry, make_protocol
from ..trajectory import Trajectory
from ..weights import EngineWeightReceiver, WeightEndpoint
from .agent_loop import AgentLoop, PromptItem
from .engine import EngineSpec, VLLMEngine

T = TypeVar("T")


def rollout_protocol(rollout: RolloutConfig, tools: ToolRegistry, model_path: str) -> ToolProtocol:
    """``rollout.protocol`` over the worker's tools. Its prompt and parsing serve a user agent too
    (``AgentExample.prompt_messages``), but only the built-in loop needs the tools its format names."""
    return make_protocol(rollout.protocol, tools.specs, rollout.prompt_file, model_path,
                         require_tools=rollout.agent == "builtin")


def _load_agent(rollout: RolloutConfig) -> Callable | None:
    """The user agent `rollout.agent` names (None: the built-in loop)."""
    if rollout.agent == "builtin":
        return None
    from .session import load_agent  # the endpoint's web stack is loaded only for user agents

    return load_agent(rollout.agent)


class IdleClock:
    """Time with no rollout in flight; rollouts may overlap (several threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._idle_since: float | None = time.perf_counter()
        self._idle_s = 0.0

    @contextmanager
    def busy(self) -> Iterator[None]:
        with self._lock:
            if self._active == 0:
                self._idle_s += time.perf_counter() - self._idle_since
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    self._idle_since = time.perf_counter()

    def take(self) -> float:
        with self._lock:
            now = time.perf_counter()
            idle = self._idle_s + (now - self._idle_since if self._active == 0 else 0.0)
            self._idle_s, self._idle_since = 0.0, now
            return idle


class RolloutWorker(WeightEndpoint):
    """``retriever`` and ``retriever_url`` set up the ``search`` tool's client; ``tools`` says which tools the
    agent gets (built-in names, MCP servers with their URLs, web tools, the result cache); None: search only.
    ``rollout.agent`` picks the driver: the built-in loop, or a user agent run against the worker's session endpoint.

    The engine and the agent loop live on an event loop thread owned by the worker. Every public method is
    synchronous and thread-safe: as a threaded Ray actor (``max_concurrency`` > 1) a weight sync or a probe may run
    while a ``generate`` is in flight; the sync then pauses generation and the requests in flight go on with the
    new weights (see `VLLMEngine`). A caller that wants every trajectory sampled by one policy waits for its
    ``generate`` calls before syncing.
    """

    def __init__(
        self, engine_spec: EngineSpec, rollout: RolloutConfig, retriever: RetrieverConfig, retriever_url: str,
        seed: int, tools: ToolsConfig | None = None,
    ) -> None:
        redirect_worker_output("rollout-engine")
        self.rollout, self.seed, self.model_path = rollout, seed, engine_spec.model_path
        # the agent and the tools first: a bad set-up fails in a second, before the engine spends its start-up time
        self.agent = _load_agent(rollout)
        self.tools = build_registry(tools or ToolsConfig(), retriever, retriever_url)
        self._events = LoopThread("rollout-engine")
        self._idle = IdleClock()
        self._rollouts: set[Future] = set()  # the generate calls in flight
        self._rollouts_lock = threading.Lock()
        try:
            protocol = rollout_protocol(rollout, self.tools, engine_spec.model_path)

            async def start_engine():  # on the loop: AsyncLLM binds to the loop it is first used on
                return VLLMEngine(engine_spec)

            self.engine = self._events.run(start_engine())
        except BaseException:
            self.tools.close()
            self._events.stop()
            raise
        self._start_driver(protocol)

    def _start_driver(self, protocol: ToolProtocol) -> None:
        """The agent loop over `self.tools`, and the user agent's endpoint when there is one."""
        self.loop = AgentLoop(self.engine, protocol, self.tools, self.rollout, self.seed)
        self.driver = self.loop
        if self.agent is not None:
            from .session import AgentRunner, SessionEndpoint

            endpoint = SessionEndpoint(self.engine, self.tools, self.rollout, self.seed, self.loop.logit_bias)
            self.driver = AgentRunner(endpoint, self.agent, self.loop.prompt_messages, self.rollout)

    def _stop_driver(self) -> None:
        if self.driver is not self.loop:
            self._run(self.driver.endpoint.stop())
            self.driver.stop()
        self.tools.close()

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self._events.run(coroutine)

    def generate(self, items: Sequence[PromptItem], step: int) -> list[Trajectory]:
        with self._idle.busy():
            rollout = self._events.submit(self.driver.run(items, step))
            with self._rollouts_lock:
                self._rollouts.add(rollout)
            try:
                return rollout.result()
            finally:
                with self._rollouts_lock:
                    self._rollouts.discard(rollout)

    def adopt(self, tools: ToolsConfig, rollout: RolloutConfig, seed: int, timeout_s: float = 60.0) -> int:
        """A new driver takes this worker over: the engine outlived the driver that started it (a detached actor,
        under `rlsearch train --restarts`). The old driver's rollouts are cancelled (vLLM aborts their requests),
        and the agent loop is set up anew for the new driver: its rollout settings (the agent, protocol, turns,
        sampling; the engine's own, which the pool matched, stay), sampling seed and tools (`tools`, its servers).
        The weights stay what the old driver left, possibly half-loaded: the new driver syncs before it generates.
        Returns the rollouts cancelled."""
        with self._rollouts_lock:
            rollouts = list(self._rollouts)
        for pending in rollouts:
            pending.cancel()
        wait(rollouts, timeout=timeout_s)
        self._stop_driver()
        if rollout.agent != self.rollout.agent:
            self.agent = _load_agent(rollout)
        self.rollout, self.seed = rollout, seed
        self.tools = build_registry(tools, tools.retriever, tools.retriever.url)
        self._start_driver(rollout_protocol(self.rollout, self.tools, self.model_path))
        return len(rollouts)

    def node_id(self) -> str:
        """The Ray node this worker runs on (the trainer reports the placement at start-up)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def idle_seconds(self) -> float:
        """Seconds without any ``generate`` in flight since the previous call (or since start-up)."""
        return self._idle.take()

    def tool_stats(self) -> dict[str, int]:
        """Requests, retries and failures summed over the tools that count them."""
        return self.tools.stats()

    def probe_sequence(self, question: str, continuation: str) -> list[int]:
        """A fixed sequence for engine-vs-actor checks: a real prompt followed by a fixed continuation."""
        return self.loop.prompt_ids(question) + self.engine.tokenizer.encode(continuation, add_special_tokens=False)

    def score(self, token_ids: list[int]) -> list[float]:
        """Teacher-forced logprobs of the raw model (temperature 1, no bias) of every token after the first."""
        return self._run(self.engine.score(token_ids))

    def sample_probe(self, prompt_ids: list[int], num_tokens: int, seed: int) -> tuple[list[int], list[float]]:
        """Tokens sampled after `prompt_ids` at the rollout's distribution and their logprobs (the probe check)."""
        return self._run(self.loop.sample_probe(prompt_ids, num_tokens, seed))

    def token_logit_bias(self) -> dict[int, float]:
        """rollout.logit_bias as the engine applies it: token id -> bias."""
        return dict(self.loop.logit_bias)

    @property
    def weight_receiver(self) -> EngineWeightReceiver:
        """The engine's end of the weight path; `WeightEndpoint` names its calls."""
        return self.engine.weights

    def shutdown(self) -> None:
        self._stop_driver()
        self._run(self.engine.shutdown())
        self._events.stop()
