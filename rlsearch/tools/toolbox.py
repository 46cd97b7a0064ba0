"""Tools from config: the protocol, the tool registry, and the local tool servers a run starts."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import MCPServerConfig, RetrieverConfig, ToolsConfig
from .base import Tool, ToolSetupError, ToolSpec
from .cache import ToolCache
from .call_tool import CallToolProtocol
from .protocol import SearchR1Protocol, ToolProtocol
from .registry import ToolRegistry
from .server_process import MCPServerProcess, RetrieverProcess

if TYPE_CHECKING:
    from typing import Self

PROTOCOLS: dict[str, type[ToolProtocol]] = {"search_r1": SearchR1Protocol, "call_tool": CallToolProtocol}


def make_protocol(name: str, tools: Sequence[ToolSpec], prompt_file: str = "") -> ToolProtocol:
    """The protocol ``name`` listing ``tools`` in its prompt; a tool its tags name must be among them."""
    if name not in PROTOCOLS:
        raise ToolSetupError(f"unknown protocol {name!r}; choose one of {', '.join(PROTOCOLS)}")
    protocol = PROTOCOLS[name](tools, prompt_file or None)
    available = {tool.name for tool in tools}
    missing = [tool for tool in protocol.required_tools if tool not in available]
    if missing:
        raise ToolSetupError(
            f"protocol '{name}' calls the tool(s) {', '.join(missing)}, which no enabled tool provides "
            f"(enabled: {', '.join(sorted(available)) or 'none'}); add it to tools.enabled or to an MCP server's "
            "allow list"
        )
    return protocol


def build_registry(tools: ToolsConfig, retriever: RetrieverConfig, retriever_url: str) -> ToolRegistry:
    """The registry of ``tools.enabled`` plus the tools of ``tools.mcp.servers`` (URLs already resolved)."""
    built: list[Tool] = []
    try:
        for name in tools.enabled:
            if name not in _BUILDERS:
                raise ToolSetupError(f"unknown tool {name!r} in tools.enabled; built-in tools: {', '.join(_BUILDERS)}")
            built.append(_BUILDERS[name](tools, retriever, retriever_url))
        if tools.mcp.servers:
            from .mcp_client import MCPServerSpec, MCPToolset

            specs = [MCPServerSpec(server.url, tuple(server.allow), server.token_env) for server in tools.mcp.servers]
            mcp = tools.mcp
            built.extend(MCPToolset(specs, mcp.timeout_s, mcp.max_retries, mcp.backoff_s, mcp.max_concurrency).tools)
        return ToolRegistry(built, ToolCache(tools.cache_dir) if tools.cache_dir else None)
    except BaseException:
        for tool in built:
            tool.close()
        raise


def _search(tools: ToolsConfig, retriever: RetrieverConfig, retriever_url: str) -> Tool:
    from .client import RetrievalClient, SearchTool

    if not retriever_url:
        raise ToolSetupError("the search tool needs a retrieval server: set tools.retriever.url or start one")
    return SearchTool(RetrievalClient(
        retriever_url, topk=retriever.topk, timeout_s=retriever.timeout_s, max_retries=retriever.max_retries,
        backoff_s=retriever.backoff_s, batch_size=retriever.batch_size, max_concurrency=retriever.max_concurrency,
        token_env=retriever.token_env,
    ))


def _browse(tools: ToolsConfig, *_: object) -> Tool:
    from .browse import BrowseTool, SafeFetcher, URLGuard

    config = tools.browse
    fetcher = SafeFetcher(URLGuard(config.allow_networks), config.timeout_s, config.max_bytes, config.max_redirects)
    return BrowseTool(fetcher, config.max_chars, config.max_concurrency)


def _web_search(tools: ToolsConfig, *_: object) -> Tool:
    from .web import SerperSearchTool, api_key

    config = tools.serper
    key = api_key(config.api_key_env, "web_search")
    return SerperSearchTool(config.url, key, config.num_results, config.timeout_s, config.max_retries)


def _web_browse(tools: ToolsConfig, *_: object) -> Tool:
    from .web import JinaReaderTool, api_key

    config = tools.jina
    key = api_key(config.api_key_env, "web_browse")
    return JinaReaderTool(config.url, key, config.max_chars, config.timeout_s, config.max_retries)


_BUILDERS: dict[str, Callable[[ToolsConfig, RetrieverConfig, str], Tool]] = {
    "search": _search, "browse": _browse, "web_search": _web_search, "web_browse": _web_browse,
}


class ToolServers:
    """The local servers a run needs: the retriever (for ``search`` when ``tools.retriever.url`` is empty) and
    ``rlsearch serve-mcp`` (when ``tools.mcp.start_local``). ``tools`` is the config with their URLs filled in.

    Both bind 127.0.0.1 and inherit this process's environment: the retriever requires the token in
    ``tools.retriever.token_env`` when that variable is set, the MCP server the one in RLSEARCH_MCP_TOKEN."""

    def __init__(self, tools: ToolsConfig) -> None:
        self.config = tools
        self.tools = tools
        self.retriever: RetrieverProcess | None = None
        self.mcp: MCPServerProcess | None = None

    @property
    def retriever_url(self) -> str:
        return self.tools.retriever.url

    def start(self) -> Self:
        retriever = self.config.retriever
        needs_retriever = "search" in self.config.enabled and not retriever.url
        if needs_retriever or self.config.mcp.start_local:
            if not Path(retriever.corpus).is_file():
                raise ToolSetupError(f"'tools.retriever.corpus' not found: {retriever.corpus}")
        try:
            if needs_retriever:
                self.retriever = RetrieverProcess(
                    retriever.corpus, token_env=retriever.token_env, **_server_options(retriever)
                ).start()
                retriever = dataclasses.replace(retriever, url=self.retriever.url)
            mcp = self.config.mcp
            if mcp.start_local:
                token_env = MCPServerConfig().token_env  # the local server's entry keeps the default variable
                self.mcp = MCPServerProcess(retriever.corpus, token_env=token_env, **_server_options(retriever)).start()
                mcp = dataclasses.replace(mcp, servers=[*mcp.servers, MCPServerConfig(url=self.mcp.url)])
        except BaseException:
            self.stop()
            raise
        self.tools = dataclasses.replace(self.config, retriever=retriever, mcp=mcp)
        return self

    def stop(self) -> None:
        for process in (self.mcp, self.retriever):
            if process is not None:
                process.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _server_options(retriever: RetrieverConfig) -> dict:
    return {"cache_dir": retriever.index_cache_dir, "backend": retriever.backend, "encoder": retriever.encoder}
