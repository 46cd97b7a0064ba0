"""Serper search and Jina reader adapters: the real client code against a local server speaking their HTTP API."""

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from threaded_server import serve_in_thread

from rlsearch.config import EndpointConfig, RetrieverConfig, ToolsConfig
from rlsearch.tools import ErrorKind, ToolCall, ToolSetupError, build_registry
from rlsearch.tools.clients.web import JinaReaderTool, SerperSearchTool, WebEndpoint

KEY = "test-key-123"
ATTEMPTS: dict[str, int] = {}


async def serper(request: Request) -> JSONResponse:
    if request.headers.get("x-api-key") != KEY:
        return JSONResponse({"message": "Unauthorized."}, status_code=403)
    body = await request.json()
    if body["q"] == "flaky":  # fails twice, then answers: the client must retry
        ATTEMPTS["flaky"] = ATTEMPTS.get("flaky", 0) + 1
        if ATTEMPTS["flaky"] <= 2:
            return JSONResponse({"message": "busy"}, status_code=503)
    organic = [
        {"title": f"{body['q']} result {i}", "link": f"https://example.org/{i}", "snippet": f"snippet {i}",
         "position": i}
        for i in range(1, 11)
    ]
    return JSONResponse({"searchParameters": {"q": body["q"], "num": body["num"]}, "organic": organic[: body["num"]]})


async def jina(request: Request) -> JSONResponse:
    if request.headers.get("authorization") != f"Bearer {KEY}" or request.headers.get("accept") != "application/json":
        return JSONResponse({"code": 401, "message": "bad key"}, status_code=401)
    page_url = request.url.path.removeprefix("/") + (f"?{request.url.query}" if request.url.query else "")
    content = f"# Page\nThe content of {page_url}. " + "More text. " * 100
    return JSONResponse({"code": 200, "status": 20000, "data": {"title": "Page", "url": page_url, "content": content}})


@pytest.fixture
def unused_url() -> str:
    """A loopback URL nothing listens on: connections are refused, as to a killed server."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}/search"


@pytest.fixture(scope="module")
def api():
    routes = [Route("/search", serper, methods=["POST"]), Route("/{rest:path}", jina)]
    with serve_in_thread(Starlette(routes=routes)) as url:
        yield url


def test_serper_search_returns_snippets_through_the_real_client(api: str) -> None:
    tool = SerperSearchTool([WebEndpoint(f"{api}/search", KEY)], num_results=3, backoff_s=0.01)
    (result,) = tool.run_batch([ToolCall("web_search", "velmora mayor")])
    assert [d.title for d in result.documents] == [f"velmora mayor result {i}" for i in (1, 2, 3)]
    assert [(d.url, d.text) for d in result.documents][0] == ("https://example.org/1", "snippet 1")
    tool.close()


def test_serper_retries_server_errors_then_succeeds(api: str) -> None:
    tool = SerperSearchTool([WebEndpoint(f"{api}/search", KEY)], num_results=2, max_retries=2, backoff_s=0.01)
    (result,) = tool.run_batch([ToolCall("web_search", "flaky")])
    assert result.ok and len(result.documents) == 2 and ATTEMPTS["flaky"] == 3
    tool.close()


def test_serper_wrong_key_is_a_tool_error_not_a_crash(api: str) -> None:
    tool = SerperSearchTool([WebEndpoint(f"{api}/search", "wrong")], backoff_s=0.01)
    (result,) = tool.run_batch([ToolCall("web_search", "x")])
    assert result.error_kind is ErrorKind.TOOL_ERROR and "rejected: HTTP 403" in result.error
    tool.close()


def test_jina_reader_returns_the_page_as_a_webpage(api: str) -> None:
    tool = JinaReaderTool([WebEndpoint(f"{api}/", KEY)], max_chars=60, backoff_s=0.01)
    page, refused = tool.run_batch([
        ToolCall("web_browse", "https://example.org/a?b=1"), ToolCall("web_browse", "file:///etc/passwd"),
    ])
    document = page.documents[0]
    assert (document.kind, document.title, document.url) == ("webpage", "Page", "https://example.org/a?b=1")
    assert document.text.startswith("# Page\nThe content of https://example.org/a?b=1.") and len(document.text) == 64
    assert refused.error_kind is ErrorKind.TOOL_ERROR and "only http and https" in refused.error
    tool.close()


def test_web_tools_refuse_to_start_without_their_api_key(monkeypatch: pytest.MonkeyPatch, api: str) -> None:
    monkeypatch.delenv("SERPER_API_KEY", raising=False)
    monkeypatch.delenv("JINA_API_KEY", raising=False)
    tools = ToolsConfig(enabled=["web_search"])
    with pytest.raises(ToolSetupError, match="tool 'web_search' needs an API key in the environment variable "
                                             "SERPER_API_KEY, which is not set"):
        build_registry(tools, RetrieverConfig(), "")
    with pytest.raises(ToolSetupError, match="JINA_API_KEY"):
        build_registry(ToolsConfig(enabled=["web_browse"]), RetrieverConfig(), "")
    monkeypatch.setenv("SERPER_API_KEY", KEY)
    tools.serper.url = f"{api}/search"
    registry = build_registry(tools, RetrieverConfig(), "")
    (result,) = registry.run([ToolCall("web_search", "from config")])
    assert len(result.documents) == tools.serper.num_results == 5
    registry.close()


def test_web_search_fails_over_past_a_dead_endpoint_and_skips_it_while_it_cools_down(
    monkeypatch: pytest.MonkeyPatch, api: str, unused_url: str,
) -> None:
    monkeypatch.setenv("SERPER_API_KEY", KEY)
    tools = ToolsConfig(enabled=["web_search"])
    tools.serper.endpoints = [EndpointConfig(unused_url, api_key_env="SERPER_API_KEY"),
                              EndpointConfig(f"{api}/search", api_key_env="SERPER_API_KEY")]
    tools.serper.max_retries, tools.serper.cooldown_s = 0, 60.0
    registry = build_registry(tools, RetrieverConfig(), "")
    first, second = (registry.run([ToolCall("web_search", query)])[0] for query in ("first", "second"))
    assert [d.title for d in first.documents][:1] == ["first result 1"]
    assert [d.title for d in second.documents][:1] == ["second result 1"]
    assert registry.stats()["failovers"] == 1  # the second call went straight to the live endpoint
    registry.close()
    # both dead: a counted error observation after one round, no hang
    tool = SerperSearchTool([WebEndpoint(unused_url, KEY), WebEndpoint(unused_url + "/again", KEY)], max_retries=0)
    (dead,) = tool.run_batch([ToolCall("web_search", "x")])
    assert dead.error_kind is ErrorKind.TOOL_ERROR and "failed after 2 attempts over 2 endpoints" in dead.error
    assert tool.endpoints.exhausted == 1 and tool.stats() == {"failovers": 1}
    tool.close()
