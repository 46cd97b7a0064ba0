"""What a user agent gets: its session (endpoint URL, tools, limits) and its example."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ...tools import ToolCall, ToolRegistry, ToolResult, ToolSpec
from ...tools.protocols.chat_tools import openai_tool_schemas
from ...trajectory import ToolCallRecord
from .tokens import SessionTokens


@dataclass(frozen=True)
class AgentExample:
    """One prompt of the batch. ``prompt_messages`` are the messages the built-in loop would start from (the
    configured protocol's system prompt and instruction); an agent may use them or write its own."""

    id: str
    question: str
    prompt_messages: tuple[dict, ...]
    data_source: str = ""
    golden_answers: tuple[str, ...] = ()
    group_id: int = 0
    sample_index: int = 0


@dataclass
class ModelCall:
    """One call to the endpoint, as recorded."""

    text: str  # the text returned (special tokens kept, the closing end-of-turn token dropped)
    num_tokens: int
    finish_reason: str  # stop | length
    cut_by: str = ""  # finish length: the limit it ran into (turn_tokens | response_budget | context_window)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)  # calls run through session.tools after it
    answered_tool_calls: bool = False  # a chat response that carried tool calls
    # as Turn's: the engine's weight versions while it generated, its context, the prefix cache's share of it
    weight_versions: list[int] = field(default_factory=list)
    context_tokens: int = 0
    cached_tokens: int = 0
    cache_ceiling: int = 0


class SessionTools:
    """The run's tools (``tools.enabled`` and the MCP servers) for one agent: ``call`` one, or ``run`` several
    concurrently. Failures come back as results with ``ok`` False, never as exceptions."""

    def __init__(self, registry: ToolRegistry, session: AgentSession) -> None:
        self._registry = registry
        self._session = session

    @property
    def specs(self) -> list[ToolSpec]:
        return self._registry.specs

    def openai_schemas(self) -> list[dict]:
        """The tools in the OpenAI ``tools=`` form (name, description, JSON-schema parameters)."""
        return openai_tool_schemas(self.specs)

    async def call(self, name: str, query: str | None = None, /, **arguments) -> ToolResult:
        """``call("search", "who wrote ...")`` (a query) or ``call("convert_time", time="12:00", ...)`` (typed
        arguments, as a native tool call gives them)."""
        if query is not None and arguments:
            raise TypeError("give a query or keyword arguments, not both")
        call = ToolCall(name, query) if query is not None else ToolCall(name, "", arguments=arguments)
        return (await self.run([call]))[0]

    async def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """The calls' results; each call carries the trajectory's question (for a tool that reads it: browse with
        a summariser)."""
        started = time.perf_counter()
        asked = [call if call.question else replace(call, question=self._session.question) for call in calls]
        results = await asyncio.to_thread(self._registry.run, asked)
        self._session.record_tool_calls(calls, results, time.perf_counter() - started)
        return results


class AgentSession:
    """One trajectory's session: ``base_url`` is its OpenAI-compatible endpoint (``openai()`` gives a client of
    it), ``tools`` the configured tools, ``max_turns`` and ``assistant_prefix`` the rollout settings an agent may
    follow. Every model call through ``base_url`` is recorded token-exactly (see tokens.py)."""

    def __init__(
        self, session_id: str, base_url: str, model: str, tokens: SessionTokens, registry: ToolRegistry,
        max_turns: int, assistant_prefix: str, question: str = "",
    ) -> None:
        self.id = session_id
        self.question = question  # the example's question, which the tools that read it get
        self.base_url = base_url
        self.model = model
        self.tokens = tokens
        self.tools = SessionTools(registry, self)
        self.max_turns = max_turns
        self.assistant_prefix = assistant_prefix
        self.calls: list[ModelCall] = []
        # why a call was refused, ending the trajectory: response_budget (rollout.max_response_tokens used up) or
        # context_window (the prompt fills rollout.context_window); "" while none was
        self.refused_for = ""
        self.generate_s = 0.0
        self.tool_s = 0.0
        self.weight_versions: set[int] = set()
        self.shared_client = None  # the runner's openai.AsyncOpenAI, set before the agent starts

    def openai(self):
        """An ``openai.AsyncOpenAI`` client of this session. It shares the runner's connection pool: a client of its
        own (``AsyncOpenAI(base_url=session.base_url, ...)``) works too, but costs ~30 ms to create."""
        return self.shared_client.with_options(base_url=self.base_url)

    def record_tool_calls(self, calls: Sequence[ToolCall], results: Sequence[ToolResult], waited: float) -> None:
        self.tool_s += waited
        records = [
            ToolCallRecord(name=call.name, query=call.query, ok=result.ok, error=result.error,
                           latency_s=result.latency_s, attrs=dict(call.attrs), cached=result.cached,
                           arguments=call.arguments, error_kind=result.error_kind.value if result.error_kind else None,
                           unavailable=result.unavailable)
            for call, result in zip(calls, results)
        ]
        if self.calls:
            self.calls[-1].tool_calls.extend(records)
