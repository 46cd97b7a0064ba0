"""The tool registry from config: the built-in tools of ``tools.enabled`` and the tools of the MCP servers."""

from __future__ import annotations

from collections.abc import Callable

from ...config import RetrieverConfig, ToolsConfig, store_dir
from ...config.prompt import PromptFile
from ..base import Tool, ToolCall, ToolResult, ToolSetupError, ToolSpec
from .cache import ToolCache
from .registry import ToolRegistry


def build_registry(tools: ToolsConfig, retriever: RetrieverConfig, retriever_url: str) -> ToolRegistry:
    """The registry of ``tools.enabled`` plus the tools of ``tools.mcp.servers`` (URLs already resolved;
    stdio servers are started here and stopped by the registry's ``close``); their specs go into the store. With
    ``tools.replay``: the tools the store recorded, answered from it alone."""
    store = ToolCache(tools.cache_dir) if store_dir(tools.cache_dir) else None
    if tools.replay:
        return ToolRegistry([StoredTool(spec) for spec in store.load_specs()], store, replay=True)
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
        registry = ToolRegistry(built, store)
        if store is not None:
            store.save_specs(registry.specs)
        return registry
    except BaseException:
        for tool in built:
            tool.close()
        raise


class StoredTool(Tool):
    """A recorded tool under tools.replay: its spec, for the prompt; the registry answers its calls from the store."""

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec

    def run_batch(self, calls: list[ToolCall]) -> list[ToolResult]:
        raise ToolSetupError(f"'{self.spec.name}' is replayed from the store: it cannot be called")


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
    from .browse import BrowseAgent, BrowseTool, SafeFetcher, URLGuard
    from .summarise import SUMMARY_PROMPT, build_summariser

    config = tools.browse
    agent = None
    summariser_config = config.summariser
    summariser = build_summariser(summariser_config)
    if summariser is not None:
        prompt = PromptFile.load(summariser_config.prompt_file, SUMMARY_PROMPT, ("question", "query", "page"),
                                 "tools.browse.summariser.prompt_file")
        agent = BrowseAgent(summariser, prompt, summariser_config.max_page_chars)
    fetcher = SafeFetcher(URLGuard(config.allow_networks), config.timeout_s, config.max_bytes, config.max_redirects)
    return BrowseTool(fetcher, config.max_chars, config.max_concurrency, agent)


def _web_search(tools: ToolsConfig, *_: object) -> Tool:
    from .web import SerperSearchTool, web_endpoints

    config = tools.serper
    return SerperSearchTool(web_endpoints(config, "web_search"), config.num_results, config.timeout_s,
                            config.max_retries, cooldown_s=config.cooldown_s, deadline_s=config.deadline_s)


def _web_browse(tools: ToolsConfig, *_: object) -> Tool:
    from .web import JinaReaderTool, web_endpoints

    config = tools.jina
    return JinaReaderTool(web_endpoints(config, "web_browse"), config.max_chars, config.timeout_s, config.max_retries,
                          cooldown_s=config.cooldown_s, deadline_s=config.deadline_s)


_BUILDERS: dict[str, Callable[[ToolsConfig, RetrieverConfig, str], Tool]] = {
    "search": _search, "browse": _browse, "web_search": _web_search, "web_browse": _web_browse,
}
