"""MCP tools from one or more servers, over streamable HTTP or stdio, on the official ``mcp`` 2.x SDK.

At start-up each server's tools are listed (``allow`` picks which ones the agent gets); each tool's JSON input
schema becomes its ``ToolSpec.parameters``. A call with typed ``arguments`` (a JSON ``<call_tool>`` body) sends
them as they are; a call ``<call_tool name="NAME" k="v">query</call_tool>`` becomes ``call_tool(NAME, {main:
query, k: v})``, where ``main`` is the tool's first required string parameter and attribute values are converted to
the schema's types. Each server has one persistent session, opened on first use and re-opened after the server
went away; calls have a timeout, transport failures are retried with exponential backoff, and at most
``max_concurrency`` calls are in flight. Every failure becomes a ``ToolResult`` error, so a dead server gives error
observations, not a dead rollout, and a restarted server is used again by later calls.

HTTP: when a server's token variable (``token_env``) is set, its requests carry ``Authorization: Bearer <token>``;
a 401/403 answer is reported at once (not retried) with the variable to set.

stdio: rlsearch starts the ``command`` (with its environment plus ``env``) and stops it on ``close``. When the
process dies, the calls in flight fail, the session is dropped, and the next attempt starts a new process (counted
as ``restarts``). The server's stderr passes through to ours; its last lines go into start-up error messages.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import threading
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from ...loop_thread import LoopThread
from ..base import Document, ErrorKind, Tool, ToolCall, ToolError, ToolResult, ToolSetupError, ToolSpec
from ..http import MCP_TOKEN_ENV, auth_hint, bearer_headers

_SCHEMA_TYPES = {"integer": int, "number": float, "string": str}


@dataclass(frozen=True)
class MCPServerSpec:
    url: str = ""  # streamable HTTP endpoint, e.g. http://127.0.0.1:8001/mcp; empty for a stdio server
    allow: tuple[str, ...] = ()  # tool names to expose; empty: every tool the server lists
    token_env: str = MCP_TOKEN_ENV  # variable holding the server's bearer token; unset or "": none sent (HTTP)
    command: tuple[str, ...] = ()  # a stdio server: the process to start, e.g. (python, -m, mcp_server_time)
    env: dict[str, str] = field(default_factory=dict)  # set for the stdio server on top of rlsearch's environment

    @property
    def label(self) -> str:
        """The server as error messages name it: its URL or its command line."""
        return self.url or shlex.join(self.command)


class _Connection:
    """One MCP session to one server, held open by a task; ``reset`` drops it so the next use reconnects.

    The SDK client runs a task group: a transport failure cancels the task that entered it. Entering it in a
    holder task of its own keeps that failure away from the callers, who see a failed request instead. Only the
    transport differs between HTTP and stdio (``_http_transport``, ``_stdio_transport``); a stdio session that is
    dropped takes its server process with it, so re-opening it restarts the server.
    ``refusal`` is set when a retry would fail the same way: the server answered 401/403 (the SDK reports only a
    generic error then), or the stdio command cannot be run.
    """

    def __init__(self, server: MCPServerSpec, config_key: str, connect_timeout_s: float) -> None:
        self.server = server
        self.label = server.label
        self.config_key = config_key  # where the server is configured, e.g. tools.mcp.servers[0]
        self.connect_timeout_s = connect_timeout_s
        self.refusal = ""
        self.starts = 0
        self._stderr_tail = ""  # the last stderr lines of the latest stdio server process
        self._client = None
        self._holder: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    async def client(self) -> tuple[Any, bool]:
        """The session, opened if need be, and whether opening it restarted a stdio server process."""
        async with self._lock:
            if self._client is not None:
                return self._client, False
            ready = asyncio.get_running_loop().create_future()
            self._holder = asyncio.create_task(self._hold(ready))
            try:
                await asyncio.wait_for(asyncio.shield(ready), self.connect_timeout_s)
            except asyncio.TimeoutError:
                await self._stop_holder()
                raise ToolError(
                    f"connecting to MCP server {self.label} timed out after {self.connect_timeout_s:g} s"
                ) from None
            except BaseException:  # a failed start, or the caller gave up (cancelled): no half-started server
                await self._stop_holder()
                raise
            self.starts += 1
            return self._client, bool(self.server.command) and self.starts > 1

    async def reset(self, stale: Any = None) -> None:
        """Drop the session (only if it is still ``stale``, when given: a concurrent call may have replaced it)."""
        async with self._lock:
            if stale is None or stale is self._client:
                await self._stop_holder()

    async def _hold(self, ready: asyncio.Future) -> None:
        from mcp import Client

        self.refusal = ""
        opener = self._stdio_transport() if self.server.command else self._http_transport()
        try:
            async with opener as transport, Client(transport) as client:
                self._client = client
                ready.set_result(None)
                await asyncio.Event().wait()  # until cancelled by reset(), or the transport fails
        except asyncio.CancelledError:
            if not ready.done():
                ready.cancel()
        except Exception as error:  # a failure to connect reaches the caller through `ready`
            if not ready.done():
                ready.set_exception(ToolError(self._start_failure(error)))
        finally:
            self._client = None

    @asynccontextmanager
    async def _http_transport(self) -> AsyncIterator[Any]:
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        headers = bearer_headers(self.server.token_env)
        hint = auth_hint(self.server.token_env, bool(headers), f"{self.config_key}.token_env")

        async def note_refusal(response: httpx2.Response) -> None:
            if response.status_code in (401, 403):
                self.refusal = f"HTTP {response.status_code}: {hint}"

        # the SDK's default timeouts (30 s, 300 s to read a stream); calls have their own timeout on top
        http = httpx2.AsyncClient(
            headers=headers, timeout=httpx2.Timeout(30.0, read=300.0), event_hooks={"response": [note_refusal]}
        )
        async with http:
            yield streamable_http_client(self.server.url, http_client=http)

    @asynccontextmanager
    async def _stdio_transport(self) -> AsyncIterator[Any]:
        from mcp.client.stdio import StdioServerParameters, stdio_client

        executable, *arguments = self.server.command
        parameters = StdioServerParameters(
            command=executable, args=arguments, env={**os.environ, **self.server.env}
        )
        stderr = _StderrTail()
        try:
            yield stdio_client(parameters, errlog=stderr.writer)
        finally:
            self._stderr_tail = stderr.close()

    def _start_failure(self, error: BaseException) -> str:
        """Why the session could not be opened, with what to do about it."""
        if not self.server.command:
            return f"cannot reach MCP server {self.label}: {self.refusal or _describe(error)}"
        leaf = _leaf(error)
        command_key = f"{self.config_key}.command"
        if isinstance(leaf, FileNotFoundError):
            self.refusal = (
                f"command {self.server.command[0]!r} not found; install it, or give its full path in {command_key}"
            )
        elif isinstance(leaf, PermissionError):
            self.refusal = f"command {self.server.command[0]!r} is not executable; fix {command_key}"
        if self.refusal:
            return self.refusal
        stderr = f"; its stderr ends: {self._stderr_tail}" if self._stderr_tail else ""
        return f"the server process did not start ({_describe(error)}; check {command_key}){stderr}"

    async def _stop_holder(self) -> None:
        if self._holder is not None:
            self._holder.cancel()
            await asyncio.gather(self._holder, return_exceptions=True)
        self._holder, self._client = None, None


class _StderrTail:
    """A pipe for a server process's stderr: a thread copies it to ours and keeps the last lines."""

    def __init__(self, max_lines: int = 3) -> None:
        read_fd, write_fd = os.pipe()
        self.writer = open(write_fd, "w")  # the process gets a copy; ours is closed once the process is gone
        self._lines: deque[str] = deque(maxlen=max_lines)
        self._thread = threading.Thread(target=self._copy, args=(read_fd,), name="mcp-stderr", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 1.0) -> str:
        """The last lines, once the process's end of the pipe is closed (a process that left children holding it
        open gives what arrived within ``timeout_s``)."""
        self.writer.close()
        self._thread.join(timeout_s)
        return " | ".join(self._lines)

    def _copy(self, read_fd: int) -> None:
        with open(read_fd, encoding="utf-8", errors="replace") as reader:
            for line in reader:
                sys.stderr.write(line)
                if line.strip():
                    self._lines.append(line.strip())


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
        self._connections = [
            _Connection(server, f"tools.mcp.servers[{index}]", timeout_s) for index, server in enumerate(servers)
        ]
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
                client, _ = await connection.client()
                listing = await asyncio.wait_for(client.list_tools(), self.timeout_s)
                break
            except Exception as error:  # any failure to list is retried (unless refused: it would be again)
                refusal = connection.refusal
                last_error = refusal or _describe(error)
                await connection.reset()
                if refusal:
                    break
        if listing is None:
            raise ToolSetupError(f"cannot list the tools of MCP server {server.label}: {last_error}")
        listed = {tool.name: tool for tool in listing.tools}
        missing = [name for name in server.allow if name not in listed]
        if missing:
            raise ToolSetupError(
                f"MCP server {server.label} has no tool named {', '.join(missing)} (allow list); "
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
                except Exception as error:  # a transport failure (the session is dropped already): retry
                    if connection.refusal:  # the same request would fail again
                        counters["failures"] += 1
                        what = "cannot be started" if connection.server.command else "refused the request"
                        return ToolResult.failure(
                            ErrorKind.TOOL_ERROR, f"MCP server {connection.label} {what}: {connection.refusal}",
                            unavailable=True,
                        )
                    last_error = _describe(error)
                    continue
                return _tool_result(result)
            counters["failures"] += 1
            return ToolResult.failure(
                ErrorKind.TOOL_ERROR,
                f"MCP server {connection.label} unreachable after {self.max_retries + 1} attempts: {last_error}",
                unavailable=True,
            )

    @staticmethod
    async def _call_once(tool: MCPTool, arguments: dict):
        client, restarted = await tool.connection.client()
        if restarted:
            tool.counters["restarts"] += 1
        try:
            return await client.call_tool(tool.spec.name, arguments)
        except Exception:
            await tool.connection.reset(client)  # broken (a dead stdio process, a lost HTTP session): reopen next time
            raise


class MCPTool(Tool):
    """One remote tool; its calls of a turn run concurrently (bounded by the toolset's limit)."""

    def __init__(self, toolset: MCPToolset, connection: _Connection, remote) -> None:
        self.schema: dict = remote.input_schema or {"type": "object", "properties": {}}
        self.spec = ToolSpec(remote.name, (remote.description or f"the {remote.name} tool").strip(), self.schema)
        self.toolset = toolset
        self.connection = connection
        self.counters = {"requests": 0, "retries": 0, "failures": 0}
        if connection.server.command:  # a stdio server: how often a call of this tool found it dead and restarted it
            self.counters["restarts"] = 0

    def run_batch(self, calls: list[ToolCall]) -> list[ToolResult]:
        results: list[ToolResult | None] = [None] * len(calls)
        to_send: list[tuple[int, dict]] = []
        for index, call in enumerate(calls):
            if call.arguments is not None:  # typed JSON arguments go as they are; the server checks them
                to_send.append((index, call.arguments))
                continue
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


def _leaf(error: BaseException) -> BaseException:
    """The first leaf of an exception group (the SDK wraps transport errors in task-group errors)."""
    while getattr(error, "exceptions", None):
        error = error.exceptions[0]
    return error


def _describe(error: BaseException) -> str:
    leaf = _leaf(error)
    return str(leaf) if isinstance(leaf, ToolError) else f"{type(leaf).__name__}: {leaf}"
