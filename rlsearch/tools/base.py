"""Plain data shared by the tool layer: parsed calls, tool results, error kinds, and the Tool interface."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum

MAX_ERROR_CHARS = 300  # error text shown to the model is cut to this length


class ToolError(RuntimeError):
    """A tool call failed for good: a rejected request, or retries exhausted. ``unavailable``: the tool's service
    failed, not the call (unreachable, retries exhausted, a refused token, a malformed reply): the same call may
    succeed once the service is fixed."""

    def __init__(self, message: str, unavailable: bool = False) -> None:
        super().__init__(message)
        self.unavailable = unavailable


class ToolTimeout(ToolError):
    """A tool call ran past its time limit."""


class ToolSetupError(RuntimeError):
    """A tool cannot start (missing API key, unreachable MCP server at start-up, unknown tool name)."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    query: str
    attrs: dict[str, str] = field(default_factory=dict)  # extra attributes of a <call_tool> tag, as written
    # typed JSON arguments (a native tool call, a JSON <call_tool> body); None: the call is query + attrs
    arguments: dict | None = None
    # the trajectory's question, for a tool whose result depends on it (ToolSpec.reads_question: browse with a
    # summariser); the registry clears it for the others, so their calls and stored results do not depend on it
    question: str = ""


class TurnKind(str, Enum):
    TOOL_CALL = "tool_call"
    ANSWER = "answer"
    INVALID_CALL = "invalid_call"
    NONE = "none"


class ErrorKind(str, Enum):
    """Why a call produced an error observation; each kind is counted in the step metrics."""

    UNPARSEABLE = "unparseable"  # a closing tag without a well-formed call before it
    EMPTY_QUERY = "empty_query"
    UNKNOWN_TOOL = "unknown_tool"
    OVER_LIMIT = "over_limit"  # rollout.max_tool_calls or rollout.max_calls_per_tool reached
    TIMEOUT = "timeout"
    TOOL_ERROR = "tool_error"  # the tool ran and failed (server down, rejected arguments, blocked URL, ...)
    # the trajectory ended before the call ran (the turn was its last: rollout.max_turns, the response budget, the
    # context window); no observation shows it
    NOT_RUN = "not_run"


@dataclass(frozen=True)
class ParsedTurn:
    kind: TurnKind
    call: ToolCall | None = None
    answer: str | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None


def query_parameters(description: str = "the query") -> dict:
    """The JSON schema of a tool whose only parameter is a string ``query``."""
    return {"type": "object", "properties": {"query": {"type": "string", "description": description}},
            "required": ["query"]}


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict = field(default_factory=query_parameters)  # JSON schema of the arguments (native tool calls)
    reads_question: bool = False  # its result depends on ToolCall.question (which is then part of a call's identity)


@dataclass
class Document:
    """One item of a tool's output: a search hit (snippet) or a fetched page (webpage)."""

    text: str
    title: str = ""
    url: str = ""
    id: str = ""  # stable id shown to the model; derived from the content when the source has none
    kind: str = "snippet"  # snippet | webpage

    @classmethod
    def from_passage(cls, contents: str, passage_id: str = "") -> Document:
        """A Search-R1 corpus passage: '"Title"\\nbody'; the first line is the title."""
        title, _, body = contents.partition("\n")
        return cls(text=body, title=title, id=passage_id)

    @property
    def display_id(self) -> str:
        return self.id or hashlib.sha1(f"{self.url}\n{self.title}\n{self.text}".encode()).hexdigest()[:8]


@dataclass
class ToolResult:
    documents: list[Document] = field(default_factory=list)
    error: str | None = None
    error_kind: ErrorKind | None = None
    latency_s: float = 0.0
    cached: bool = False
    unavailable: bool = False  # the tool's service failed, not the call (ToolError.unavailable)

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    @classmethod
    def failure(cls, kind: ErrorKind, message: str, unavailable: bool = False) -> ToolResult:
        return cls(error=message[:MAX_ERROR_CHARS], error_kind=kind, unavailable=unavailable)

    @classmethod
    def from_exception(cls, error: BaseException) -> ToolResult:
        """A tool failure as the model will see it; an unexpected exception is a tool error, never a crash."""
        if isinstance(error, ToolTimeout):
            return cls.failure(ErrorKind.TIMEOUT, str(error), error.unavailable)
        if isinstance(error, ToolError):
            return cls.failure(ErrorKind.TOOL_ERROR, str(error), error.unavailable)
        return cls.failure(ErrorKind.TOOL_ERROR, f"{type(error).__name__}: {error}")


class Tool(ABC):
    """A callable tool. ``run_batch`` gets every call of one turn for this tool and returns one result per call."""

    spec: ToolSpec
    paid = False  # its calls go to a paid API (counted apart: paid calls per 1,000 trajectories)

    @abstractmethod
    def run_batch(self, calls: list[ToolCall]) -> list[ToolResult]:
        """Results in call order; may raise for a failure of the whole batch (every call then gets the error)."""

    def stats(self) -> dict[str, int]:
        """Request counters (requests, retries, failures) where the tool keeps them."""
        return {}

    def close(self) -> None:
        return None


class PerCallTool(Tool):
    """A tool whose calls are independent requests: a turn's calls run on a bounded thread pool."""

    def __init__(self, spec: ToolSpec, max_concurrency: int) -> None:
        self.spec = spec
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix=f"tool-{spec.name}")

    @abstractmethod
    def call(self, call: ToolCall) -> list[Document]:
        """One call; raise ToolError / ToolTimeout on failure."""

    def run_batch(self, calls: list[ToolCall]) -> list[ToolResult]:
        return list(self._pool.map(self._call_safely, calls))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _call_safely(self, call: ToolCall) -> ToolResult:
        try:
            return ToolResult(documents=self.call(call))
        except Exception as error:  # a tool failure becomes an observation, never a dead rollout
            return ToolResult.from_exception(error)
