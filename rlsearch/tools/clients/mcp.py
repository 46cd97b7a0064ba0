"""MCP tools from one or more servers over streamable HTTP, on the official ``mcp`` 2.x SDK.

At start-up each server's tools are listed (``allow`` picks which ones the agent gets). A call
``<call_tool name="NAME" k="v">query</call_tool>`` becomes ``call_tool(NAME, {main: query, k: v})``, where
``main`` is the tool's first required string parameter and attribute values are converted to the schema's types.
Each server has one persistent session, opened on first use and re-opened after the server went away; calls have
a timeout, transport failures are retried with exponential backoff, and at most ``max_concurrency`` calls are in
flight. Every failure becomes a ``ToolResult`` error, so a dead server gives error observations, not a dead
rollout, and a restarted server is used again by later calls. When a server's token variable (``token_env``) is
set, its requests carry ``Authorization: Bearer <token>``; a 401/403 answer is reported at once (not retried) with
the variable to set.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...loop_thread import LoopThread
from ..base import Document, ErrorKind, Tool, ToolCall, ToolError, ToolResult, ToolSetupError, ToolSpec
from ..http import MCP_TOKEN_ENV, auth_hint, bearer_headers

_SCHEMA_TYPES = {"integer": int, "number": float, "string": str}


@dataclass(frozen=True)
class MCPServerSpec:
    url: str  # streamable HTTP endpoint, e.g. http://127.0.0.1:8001/mcp
    allow: tuple[str, ...] = ()  # tool names to expose; empty: every tool the server lists
    token_env: str = MCP_TOKEN_ENV  # variable holding the server's bearer token; unset or "": none sent


class _Connection:
    """One MCP session to one server, held open by a task; ``reset`` drops it so the next use reconnects.

    The SDK client runs a task group: a transport failure cancels the task that entered it. Entering it in a
    holder task of its own keeps that failure away from the callers, who see a failed request instead.
    ``refusal`` is set when the server answered 401/403 (the SDK reports only a generic error then).
    """

    def __init__(self, url: str, connect_timeout_s: float, token_env: str = MCP_TOKEN_ENV) -> None:
        self.url = url
        self.connect_timeout_s = connect_timeout_s
        self.token_env = token_env
        self.refusal = ""
        self._client = None
        self._holder: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    async def client(self):
        async with self._lock:
            if self._client is None:
                ready = asyncio.get_running_loop().create_future()
                self._holder = asyncio.create_task(self._hold(ready))
                try:
                    await asyncio.wait_for(asyncio.shield(ready), self.connect_timeout_s)
                except asyncio.TimeoutError:
                    await self._stop_holder()
                    raise ToolError(f"connecting to MCP server {self.url} timed out") from None
            return self._client

    async def reset(self) -> None:
        async with self._lock:
            await self._stop_holder()

    async def _hold(self, ready: asyncio.Future) -> None:
        import httpx2
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client

        headers = bearer_headers(self.token_env)
        hint = auth_hint(self.token_env, bool(headers), "the server's token_env in tools.mcp.servers")

        async def note_refusal(response: httpx2.Response) -> None:
            if response.status_code in (401, 403):
                self.refusal = f"HTTP {response.status_code}: {hint}"

        self.refusal = ""
        # the SDK's default timeouts (30 s, 300 s to read a stream); calls have their own timeout on top
        http = httpx2.AsyncClient(
            headers=headers, timeout=httpx2.Timeout(30.0, read=300.0), event_hooks={"response": [note_refusal]}
        )
        try:
            async with http, Client(streamable_http_client(self.url, http_client=http)) as client:
                self._client = client
                ready.set_result(None)
                await asyncio.Event().wait()  # until cancelled by reset(), or the transport fails
        except asyncio.CancelledError:
            if not ready.done():
                ready.cancel()
        except Exception as error:  # a failure to connect reaches the caller through `ready`
            if not ready.done():
                reason = self.refusal or _describe(error)
                ready.set_exception(ToolError(f"cannot reach MCP server {self.url}: {reason}"))
        finally:
            self._client = None

    async def _stop_holder(self) -> None:
        if self._holder is not None:
            self._holder.cancel()
            await asyncio.gather(self._holder, return_exceptions=True)
        self._holder, self._client = None, None


class MCPToolset:
    """The tools of the configured MCP servers; ``tools`` are registry entries that share these connections."""

    def __init__(
        self,
        servers: Sequence[MCPServerSpec],
        timeout_s: float = 30.0,
        max_retries: int = 2,
        backoff_s: float = 0.5,
        max_concurrency: int = 8,
    ) -> None:
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._runner = LoopThread("mcp-client")
        self._semaphore = asyncio.Semaphore(max_concurrency)  # binds to the runner's loop on first use
        self._connections = [_Connection(server.url, timeout_s, server.token_env) for server in servers]
        self.tools: list[MCPTool] = []
        try:
            for server, connection in zip(servers, self._connections):
                self.tools.extend(self._runner.run(self._discover(server, connection)))
        except BaseException:
            self.close()
            raise

    def run_calls(self, tool: MCPTool, arguments: list[dict]) -> list[ToolResult]:
        async def run_all() -> list[ToolResult]:
            return list(await asyncio.gather(*(self._call(tool, args) for args in arguments)))

        return self._runner.run(run_all())

    def close(self) -> None:
        if self._runner.loop.is_running():

            async def disconnect_all() -> None:
                for connection in self._connections:
                    await connection.reset()

            self._runner.run(disconnect_all())
            self._runner.stop()

    async def _discover(self, server: MCPServerSpec, connection: _Connection) -> list[MCPTool]:
        last_error, listing = "", None
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                client = await connection.client()
                listing = await asyncio.wait_for(client.list_tools(), self.timeout_s)
                break
            except Exception as error:  # any failure to list is retried (unless refused: it would be again)
                refusal = connection.refusal
                last_error = refusal or _describe(error)
                await connection.reset()
                if refusal:
                    break
        if listing is None:
            raise ToolSetupError(f"cannot list the tools of MCP server {server.url}: {last_error}")
        listed = {tool.name: tool for tool in listing.tools}
        missing = [name for name in server.allow if name not in listed]
        if missing:
            raise ToolSetupError(
                f"MCP server {server.url} has no tool named {', '.join(missing)} (allow list); "
                f"it lists: {', '.join(listed) or 'none'}"
            )
        chosen = server.allow or tuple(listed)
        return [MCPTool(self, connection, listed[name]) for name in chosen]

    async def _call(self, tool: MCPTool, arguments: dict) -> ToolResult:
        connection, counters = tool.connection, tool.counters
        async with self._semaphore:
            counters["requests"] += 1
            last_error = ""
            for attempt in range(self.max_retries + 1):
                if attempt:
                    counters["retries"] += 1
                    await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
                try:
                    result = await asyncio.wait_for(self._call_once(tool, arguments), self.timeout_s)
                except asyncio.TimeoutError:
                    counters["failures"] += 1
                    return ToolResult.failure(ErrorKind.TIMEOUT, f"timed out after {self.timeout_s:g} s")
                except Exception as error:  # a transport failure: reconnect and retry
                    refusal = connection.refusal
                    await connection.reset()
                    if refusal:  # the same request would be refused again
                        counters["failures"] += 1
                        return ToolResult.failure(
                            ErrorKind.TOOL_ERROR, f"MCP server {connection.url} refused the request: {refusal}"
                        )
                    last_error = _describe(error)
                    continue
                return _tool_result(result)
            counters["failures"] += 1
            return ToolResult.failure(
                ErrorKind.TOOL_ERROR,
                f"MCP server {connection.url} unreachable after {self.max_retries + 1} attempts: {last_error}",
            )

    @staticmethod
    async def _call_once(tool: MCPTool, arguments: dict):
        client = await tool.connection.client()
        return await client.call_tool(tool.spec.name, arguments)


class MCPTool(Tool):
    """One remote tool; its calls of a turn run concurrently (bounded by the toolset's limit)."""

    def __init__(self, toolset: MCPToolset, connection: _Connection, remote) -> None:
        self.spec = ToolSpec(remote.name, (remote.description or f"the {remote.name} tool").strip())
        self.toolset = toolset
        self.connection = connection
        self.schema: dict = remote.input_schema or {}
        self.counters = {"requests": 0, "retries": 0, "failures": 0}

    def run_batch(self, calls: list[ToolCall]) -> list[ToolResult]:
        results: list[ToolResult | None] = [None] * len(calls)
        to_send: list[tuple[int, dict]] = []
        for index, call in enumerate(calls):
            try:
                to_send.append((index, tool_arguments(self.spec.name, self.schema, call)))
            except ToolError as error:
                results[index] = ToolResult.failure(ErrorKind.TOOL_ERROR, str(error))
        sent = self.toolset.run_calls(self, [arguments for _, arguments in to_send])
        for (index, _), result in zip(to_send, sent):
            results[index] = result
        return results

    def stats(self) -> dict[str, int]:
        return dict(self.counters)

    def close(self) -> None:
        self.toolset.close()


def tool_arguments(name: str, schema: dict, call: ToolCall) -> dict:
    """The ``call_tool`` arguments of a parsed call, per the tool's JSON input schema."""
    properties: dict = schema.get("properties", {})
    required = [key for key in schema.get("required", []) if key in properties]
    strings = [key for key in [*required, *properties] if properties[key].get("type") == "string"]
    if not strings:
        raise ToolError(f"tool '{name}' takes no text parameter to put the query in")
    main = strings[0]
    arguments: dict[str, Any] = {main: call.query}
    for key, text in call.attrs.items():
        if key == main or (properties and key not in properties):
            raise ToolError(f"tool '{name}' has no parameter '{key}'; it takes: {', '.join(properties)}")
        arguments[key] = _convert(name, key, text, properties.get(key, {}).get("type"))
    return arguments


def _convert(tool: str, key: str, text: str, schema_type: str | None) -> Any:
    if schema_type == "boolean":
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        raise ToolError(f"tool '{tool}': parameter '{key}' must be true or false; got {text!r}")
    converter = _SCHEMA_TYPES.get(schema_type or "string", str)
    try:
        return converter(text)
    except ValueError:
        raise ToolError(f"tool '{tool}': parameter '{key}' must be of type {schema_type}; got {text!r}") from None


def _tool_result(result) -> ToolResult:
    text = "\n".join(block.text for block in result.content if getattr(block, "type", "") == "text")
    if result.is_error:
        return ToolResult.failure(ErrorKind.TOOL_ERROR, text or "the tool reported an error")
    return ToolResult(documents=_documents(result.structured_content, text))


def _documents(structured: Any, text: str) -> list[Document]:
    """Structured items ``{text, title?, url?, id?, kind?}`` (as rlsearch serve-mcp returns) become documents;
    any other result is one document holding the text content."""
    # a tool returning a list gets it wrapped as {"result": [...]}; one returning an object gets the object
    items = structured.get("result", structured) if isinstance(structured, dict) else None
    if isinstance(items, dict):
        items = [items]
    if isinstance(items, list) and all(isinstance(item, dict) and "text" in item for item in items):
        return [
            Document(
                text=str(item["text"]), title=str(item.get("title", "")), url=str(item.get("url", "")),
                id=str(item.get("id", "")), kind="webpage" if item.get("kind") == "webpage" else "snippet",
            )
            for item in items
        ]
    return [Document(text=text)] if text else []


def _describe(error: BaseException) -> str:
    """The first leaf of an exception group (the SDK wraps transport errors in task-group errors)."""
    while getattr(error, "exceptions", None):
        error = error.exceptions[0]
    return str(error) if isinstance(error, ToolError) else f"{type(error).__name__}: {error}"
