"""The tool registry: parsed calls are dispatched by tool name; failures come back as results, never exceptions."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

from ..base import ErrorKind, Tool, ToolCall, ToolResult, ToolSetupError, ToolSpec
from .cache import ToolCache, call_key


class ToolRegistry:
    """Tools by name, with an optional store of results (`ToolCache`).

    ``run`` takes every call of one agent turn: each tool gets its calls as one batch (different tools run at the
    same time), unknown names get an ``unknown_tool`` result, and a tool that raises gives every call of its batch
    an error result. A native tool call (typed ``arguments``, no query) first gets the query and attributes the
    built-in tools read (``with_query``). ``run`` may be called from several threads at once (the tools' clients
    are thread-safe); a call to a paid API (``Tool.paid``) identical to one in flight (the samples of a group often
    search alike) waits for that one's result instead of calling out again. With ``replay`` every call is answered
    from the store, and one it lacks raises `ReplayMissError`.
    """

    def __init__(self, tools: Sequence[Tool], cache: ToolCache | None = None, replay: bool = False) -> None:
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.spec.name in self._tools:
                raise ToolSetupError(
                    f"two tools are named '{tool.spec.name}' (e.g. a built-in tool and an MCP tool); "
                    "drop one from tools.enabled or from the MCP server's allow list"
                )
            self._tools[tool.spec.name] = tool
        if replay and cache is None:
            raise ToolSetupError("tools.replay needs the store of a recorded run (tools.cache_dir)")
        self.cache = cache
        self.replay = replay
        self.calls_out = 0  # calls that reached a tool (not answered by the store or by an identical call in flight)
        self.paid_calls_out = 0  # of those, calls to a paid API (Tool.paid)
        self._in_flight: dict[str, Future] = {}
        self._in_flight_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self._tools)), thread_name_prefix="tool-registry")

    @property
    def specs(self) -> list[ToolSpec]:
        return [tool.spec for tool in self._tools.values()]

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        results: list[ToolResult | None] = [None] * len(calls)
        calls = list(calls)
        owned: list[int] = []  # the calls this thread makes
        leading: dict[str, tuple[int, Future]] = {}  # of those, the paid ones others may wait on, by identity
        shared: list[tuple[int, Future]] = []  # calls answered by an identical paid call in flight
        for index, call in enumerate(calls):
            if call.name not in self._tools:
                available = ", ".join(self._tools) or "none"
                results[index] = ToolResult.failure(
                    ErrorKind.UNKNOWN_TOOL, f"unknown tool '{call.name}'; available tools: {available}"
                )
                continue
            spec = self._tools[call.name].spec
            call = calls[index] = with_query(call if spec.reads_question else replace(call, question=""),
                                             spec.parameters)
            cached = self.cache.get(call) if self.cache else None
            if cached is not None:
                results[index] = ToolResult(documents=cached, cached=True)
            elif self.replay:
                raise self.cache.miss(call)
            elif not self._tools[call.name].paid:  # a local tool: every call goes out (its server merges them)
                owned.append(index)
            else:
                key = call_key(call)
                with self._in_flight_lock:
                    future = leading[key][1] if key in leading else self._in_flight.get(key)
                    if future is None:
                        leading[key] = (index, Future())
                        self._in_flight[key] = leading[key][1]
                        owned.append(index)
                    else:
                        shared.append((index, future))
        try:
            self._run_owned_calls(calls, owned, results)
        finally:
            for key, (index, future) in leading.items():
                # the tool raised past _run_tool: the waiting callers get an error too
                future.set_result(results[index] or ToolResult.failure(
                    ErrorKind.TOOL_ERROR, "the identical call in flight failed"))
                with self._in_flight_lock:
                    self._in_flight.pop(key, None)
        for index, future in shared:
            results[index] = replace(future.result())  # its own record; the wait was the call's latency
        return results

    def _run_owned_calls(self, calls: list[ToolCall], owned: list[int], results: list[ToolResult | None]) -> None:
        """Each tool gets its owned calls as one batch; results go into `results` and the store."""
        pending: dict[str, list[int]] = {}
        for index in owned:
            pending.setdefault(calls[index].name, []).append(index)
        batches = {name: [calls[i] for i in indices] for name, indices in pending.items()}
        for name, batch in batches.items():
            self.calls_out += len(batch)
            self.paid_calls_out += len(batch) if self._tools[name].paid else 0
        if len(batches) == 1:
            # one tool: run it in the caller's thread, so that concurrent callers (per-sample rollouts, each with its
            # own call) do not queue behind each other on the pool
            outputs = {name: self._run_tool(self._tools[name], batch) for name, batch in batches.items()}
        else:
            futures = {name: self._pool.submit(self._run_tool, self._tools[name], b) for name, b in batches.items()}
            outputs = {name: future.result() for name, future in futures.items()}
        for name, indices in pending.items():
            for index, result in zip(indices, outputs[name]):
                results[index] = result
                if self.cache and result.ok:
                    self.cache.put(calls[index], result.documents)

    def stats(self) -> dict[str, int]:
        """Request counters summed over the tools that keep them."""
        totals = {"requests": 0, "retries": 0, "failures": 0, "calls_out": self.calls_out,
                  "paid_calls_out": self.paid_calls_out}
        for tool in self._tools.values():
            for key, value in tool.stats().items():
                totals[key] = totals.get(key, 0) + value
        return totals

    def close(self) -> None:
        for tool in self._tools.values():
            tool.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _run_tool(tool: Tool, calls: list[ToolCall]) -> list[ToolResult]:
        started = time.perf_counter()
        try:
            results = tool.run_batch(calls)
            if len(results) != len(calls):
                raise RuntimeError(f"tool '{tool.spec.name}' returned {len(results)} results for {len(calls)} calls")
        except Exception as error:  # one failing tool must not end the rollout
            results = [ToolResult.from_exception(error) for _ in calls]
        latency = time.perf_counter() - started
        for result in results:
            result.latency_s = latency
        return results


def with_query(call: ToolCall, parameters: dict) -> ToolCall:
    """A native call (typed ``arguments``, empty query) in the form the built-in tools read: the tool's main parameter
    (its first required string parameter, else its first string parameter) is the query (empty when not given),
    every other argument an attribute (JSON text when not a string). The arguments stay, for tools that take them
    whole (MCP). Other calls come back as they are."""
    if call.arguments is None or call.query:
        return call
    main = _main_parameter(parameters)
    query = _as_text(call.arguments[main]) if main in call.arguments else ""
    attrs = {name: _as_text(value) for name, value in call.arguments.items() if name != main}
    return replace(call, query=query, attrs=attrs)


def _main_parameter(parameters: dict) -> str | None:
    properties = parameters.get("properties") or {}
    names = [*parameters.get("required", []), *properties]
    return next((name for name in names if (properties.get(name) or {}).get("type") == "string"), None)


def _as_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
