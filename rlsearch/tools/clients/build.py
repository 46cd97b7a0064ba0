"""The tool registry from config: the built-in tools of ``tools.enabled`` and the tools of the MCP servers."""

from __future__ import annotations

from collections.abc import Callable

from ...config import RetrieverConfig, ToolsConfig
from ..base import Tool, ToolSetupError
from .cache import ToolCache
from .registry import ToolRegistry


def build_registry(tools: ToolsConfig, retriever: RetrieverConfig, retriever_url: str) -> ToolRegistry:
    """The registry of ``tools.enabled`` plus the tools of ``tools.mcp.servers`` (URLs already resolved;
    stdio servers are started here and stopped by the registry's ``close``)."""
    built: list[Tool] = []
    try:
        for name in tools.enabled:
            if name not in _BUILDERS:
                raise ToolSetupError(f"unknown tool {name!r} in tools.enabled; built-in tools: {', '.join(_BUILDERS)}")
            built.append(_BUILDERS[name](tools, retriever, retriever_url))
        if tools.mcp.servers:
            from .mcp import MCPServerSpec, MCPToolset

            specs = [
                MCPServerSpec(
                    server.url, tuple(server.allow), server.token_env, tuple(server.command), dict(server.env)
                )
                for server in tools.mcp.servers
            ]
            mcp = tools.mcp
            built.extend(MCPToolset(specs, mcp.timeout_s, mcp.max_retries, mcp.backoff_s, mcp.max_concurrency).tools)
        return ToolRegistry(built, ToolCache(tools.cache_dir) if tools.cache_dir else None)
    except BaseException:
        for tool in built:
            tool.close()
        raise


def _search(tools: ToolsConfig, retriever: RetrieverConfig, retriever_url: str) -> Tool:
    from .retrieval import RetrievalClient, SearchTool

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
