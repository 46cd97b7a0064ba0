"""`rlsearch serve-mcp` over real HTTP on 127.0.0.1 and the MCP client: discovery, calls, failures, restarts."""

import dataclasses
import json
from urllib.parse import urlparse

import httpx
import pytest

from rlsearch.cli import build_parser
from rlsearch.tools import ErrorKind, ToolCall, ToolSetupError
from rlsearch.tools.clients.mcp import MCPServerSpec, MCPToolset, tool_arguments
from tests.concurrency import InFlight


@pytest.fixture(scope="module")
def toolset(mcp_server):
    toolset = MCPToolset([MCPServerSpec(mcp_server.url)], timeout_s=10, max_retries=2, backoff_s=0.05)
    yield toolset
    toolset.close()


def by_name(toolset: MCPToolset) -> dict:
    return {tool.spec.name: tool for tool in toolset.tools}


def test_mcp_server_binds_loopback_and_lists_search_and_browse(mcp_server, toolset) -> None:
    address = urlparse(mcp_server.url)
    assert (address.hostname, address.path) == ("127.0.0.1", "/mcp")
    assert httpx.get(f"http://127.0.0.1:{address.port}/health").json() == {"status": "ok", "num_documents": 180}
    assert sorted(by_name(toolset)) == ["browse", "search"]
    assert "query" in by_name(toolset)["search"].schema["properties"]


def test_mcp_search_finds_the_gold_passage_and_browse_reads_it(toolset, toy_data) -> None:
    rows = [json.loads(line) for line in toy_data.train.open()][:6]
    search, browse = by_name(toolset)["search"], by_name(toolset)["browse"]
    results = search.run_batch([ToolCall("search", row["question"], {"topk": "5"}) for row in rows])
    assert all(r.ok and 1 <= len(r.documents) <= 5 for r in results)
    found = sum(row["metadata"]["passage_id"] in [d.id for d in r.documents] for row, r in zip(rows, results))
    assert found >= 4
    first = results[0].documents[0]
    assert first.url == f"local://corpus/{first.id}" and first.kind == "snippet"
    (page,) = browse.run_batch([ToolCall("browse", first.url)])
    assert page.documents[0].kind == "webpage" and page.documents[0].text == first.text
    corpus = {json.loads(line)["id"]: json.loads(line)["contents"] for line in toy_data.corpus.open()}
    assert corpus[first.id].endswith(first.text)


def test_mcp_tool_errors_are_results_not_exceptions(toolset) -> None:
    search, browse = by_name(toolset)["search"], by_name(toolset)["browse"]
    bad_attr, bad_topk, out_of_range = search.run_batch([
        ToolCall("search", "q", {"color": "red"}), ToolCall("search", "q", {"topk": "many"}),
        ToolCall("search", "q", {"topk": "1000"}),
    ])
    assert bad_attr.error == "tool 'search' has no parameter 'color'; it takes: query, topk"
    assert bad_topk.error == "tool 'search': parameter 'topk' must be of type integer; got 'many'"
    assert "topk must be between 1 and 100" in out_of_range.error
    (missing,) = browse.run_batch([ToolCall("browse", "local://corpus/no-such-id")])
    assert missing.error_kind is ErrorKind.TOOL_ERROR and "no document at" in missing.error


def test_mcp_arguments_follow_the_input_schema() -> None:
    schema = {
        "properties": {"k": {"type": "integer"}, "url": {"type": "string"}, "deep": {"type": "boolean"},
                       "w": {"type": "number"}},
        "required": ["url"],
    }
    call = ToolCall("t", "https://x.org", {"k": "3", "deep": "True", "w": "0.5"})
    assert tool_arguments("t", schema, call) == {"url": "https://x.org", "k": 3, "deep": True, "w": 0.5}


def test_mcp_allow_list_selects_tools_and_names_missing_ones(mcp_server) -> None:
    only_browse = MCPToolset([MCPServerSpec(mcp_server.url, ("browse",))], timeout_s=10)
    assert [t.spec.name for t in only_browse.tools] == ["browse"]
    only_browse.close()
    with pytest.raises(ToolSetupError, match=r"has no tool named fetch \(allow list\); it lists: search, browse"):
        MCPToolset([MCPServerSpec(mcp_server.url, ("search", "fetch"))], timeout_s=10)


def test_mcp_unreachable_server_at_start_up_is_a_clear_error(mcp_server) -> None:
    url = "http://127.0.0.1:9/mcp"
    with pytest.raises(ToolSetupError, match="cannot list the tools of MCP server http://127.0.0.1:9/mcp: .*Connect"):
        MCPToolset([MCPServerSpec(url)], timeout_s=5, max_retries=1, backoff_s=0.01)


def test_mcp_server_restart_is_survived_by_the_same_client(mcp_server) -> None:
    toolset = MCPToolset([MCPServerSpec(mcp_server.url, ("search",))], timeout_s=10, max_retries=1, backoff_s=0.05)
    (search,) = toolset.tools
    assert search.run_batch([ToolCall("search", "river")])[0].ok
    mcp_server.stop()
    try:
        down = search.run_batch([ToolCall("search", "river"), ToolCall("search", "town")])
        assert [r.error_kind for r in down] == [ErrorKind.TOOL_ERROR] * 2
        assert all("unreachable after 2 attempts" in r.error for r in down)
    finally:
        mcp_server.start()  # same port
    assert search.run_batch([ToolCall("search", "river")])[0].ok
    assert search.stats() == {"requests": 4, "retries": 2, "failures": 2}
    toolset.close()


def test_serve_mcp_subcommand_parses_its_options() -> None:
    args = build_parser().parse_args(["serve-mcp", "--corpus", "c.jsonl", "--backend", "hybrid", "--port", "0"])
    assert (args.corpus, args.backend, args.port, args.host, args.transport, args.func.__name__) == (
        "c.jsonl", "hybrid", 0, "127.0.0.1", "http", "_serve_mcp"
    )
    assert build_parser().parse_args(["serve-mcp", "--corpus", "c.jsonl", "--transport", "stdio"]).transport == "stdio"


def test_tool_servers_start_local_mcp_and_fill_in_its_url(toy_data, tmp_path) -> None:
    from rlsearch.config import MCPConfig, RetrieverConfig, ToolsConfig
    from rlsearch.tools import ToolServers, build_registry

    config = ToolsConfig(
        enabled=[], mcp=MCPConfig(start_local=True, timeout_s=10),
        retriever=RetrieverConfig(corpus=str(toy_data.corpus), index_cache_dir=str(tmp_path)),
    )
    with ToolServers(config) as servers:
        assert servers.retriever is None  # no built-in search: no retrieval server
        (local,) = servers.tools.mcp.servers
        assert local.url == servers.mcp.url and local.url.startswith("http://127.0.0.1:")
        registry = build_registry(servers.tools, servers.tools.retriever, servers.retriever_url)
        assert registry.names == ["search", "browse"]
        (result,) = registry.run([ToolCall("browse", "0")])
        assert result.ok and result.documents[0].id == "0"
        registry.close()
        # the built-in search next to the MCP server's search is two tools with one name
        with_search = dataclasses.replace(servers.tools, enabled=["search"])
        with pytest.raises(ToolSetupError, match="two tools are named 'search'"):
            build_registry(with_search, servers.tools.retriever, "http://127.0.0.1:9")
    assert config.mcp.servers == []  # the caller's config is left as it was


@pytest.fixture(scope="module")
def slow_server():
    """An MCP server (real HTTP, its own thread) whose tool `sleepy` sleeps as long as asked, and `paired` holds each
    call until two are in flight at once (then as long as asked): its URL and paired's InFlight."""
    import asyncio

    from mcp.server.mcpserver import MCPServer
    from threaded_server import serve_in_thread

    server = MCPServer("slow")
    two_at_once = InFlight(meet=2)

    @server.tool(name="sleepy", description="sleeps")
    async def sleepy(seconds: str) -> str:
        await asyncio.sleep(float(seconds))
        return f"slept {seconds}"

    @server.tool(name="paired", description="waits for a second call, then sleeps")
    async def paired(seconds: str) -> str:
        async with two_at_once:
            await asyncio.sleep(float(seconds))
        return f"slept {seconds}"

    with serve_in_thread(server.streamable_http_app(stateless_http=True, json_response=True)) as url:
        yield f"{url}/mcp", two_at_once


def test_mcp_timeout_is_its_own_error_kind_and_concurrency_is_bounded(slow_server) -> None:
    url, two_at_once = slow_server
    toolset = MCPToolset([MCPServerSpec(url, allow=("sleepy",))], timeout_s=1.0, max_retries=0)
    (sleepy,) = toolset.tools
    (late,) = sleepy.run_batch([ToolCall("sleepy", "5")])
    assert (late.error_kind, late.error) == (ErrorKind.TIMEOUT, "timed out after 1 s")
    toolset.close()
    toolset = MCPToolset([MCPServerSpec(url, allow=("paired",))], timeout_s=60.0, max_retries=0, max_concurrency=2)
    (paired,) = toolset.tools
    # held until two are in flight: one call at a time would end at the server's hang guard
    results = paired.run_batch([ToolCall("paired", "0.4") for _ in range(4)])
    assert [r.error for r in results] == [None] * 4
    assert [r.documents[0].text for r in results] == ["slept 0.4"] * 4
    assert (two_at_once.calls, two_at_once.most) == (4, 2)  # and two at most: unbounded, all four would be
    toolset.close()
