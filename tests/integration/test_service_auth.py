"""Tool servers locked down: bearer tokens from environment variables, bounded requests, loopback by default.

Real servers on 127.0.0.1 (uvicorn in a thread, or the subprocess the trainer starts) and the real clients.
"""

import json

import httpx
import pytest
from threaded_server import ResponseLog, serve_in_thread

from rlsearch.cli import build_parser
from rlsearch.config import MCPConfig, MCPServerConfig, RetrieverConfig, ToolsConfig
from rlsearch.ray_setup import ray_env_defaults
from rlsearch.tools import ErrorKind, RetrievalClient, SearchTool, ToolCall, ToolServers, ToolSetupError, build_registry
from rlsearch.tools.clients.mcp import MCPServerSpec, MCPToolset
from rlsearch.tools.http import MCP_TOKEN_ENV, RETRIEVER_TOKEN_ENV
from rlsearch.tools.search_api import MAX_QUERIES, MAX_QUERY_CHARS, MAX_TOPK
from rlsearch.tools.servers.mcp import create_mcp_app
from rlsearch.tools.servers.retrieval import RequestLimits, build_retriever, create_app
from rlsearch.tools.servers.serving import ServiceGuard, exposure_warning, is_loopback

TOKEN = "s3cret-token"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def bm25(toy_data, tmp_path_factory):
    return build_retriever(str(toy_data.corpus), cache_dir=str(tmp_path_factory.mktemp("auth-bm25")))


@pytest.fixture(scope="module")
def question(toy_data) -> str:
    return json.loads(toy_data.train.open().readline())["question"]


@pytest.fixture(scope="module")
def protected_retriever(bm25):
    """The retrieval server started with RLSEARCH_RETRIEVER_TOKEN set (the variable is unset again afterwards)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv(RETRIEVER_TOKEN_ENV, TOKEN)
        app = create_app(bm25)
    assert app.requires_token
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture(scope="module")
def protected_mcp_server(bm25):
    """The MCP server's URL and the log of its responses."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv(MCP_TOKEN_ENV, TOKEN)
        app = ResponseLog(create_mcp_app(bm25))
    with serve_in_thread(app) as url:
        yield f"{url}/mcp", app


@pytest.fixture(scope="module")
def protected_mcp(protected_mcp_server) -> str:
    return protected_mcp_server[0]


def retrieve(url: str, body, headers: dict | None = None, **kwargs) -> httpx.Response:
    if "content" not in kwargs:
        kwargs["json"] = body
    return httpx.post(f"{url}/retrieve", headers=headers or {}, timeout=10.0, **kwargs)


def search_registry(url: str, **retriever_options):
    options = {"topk": 2, "max_retries": 3, "backoff_s": 0.2, **retriever_options}
    return build_registry(ToolsConfig(), RetrieverConfig(**options), url)


def test_retriever_requires_the_bearer_token(protected_retriever, question) -> None:
    body = {"queries": [question], "topk": 2}
    missing = retrieve(protected_retriever, body)
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == "Bearer"
    assert "requires a bearer token" in missing.json()["detail"]
    assert RETRIEVER_TOKEN_ENV in missing.json()["detail"]
    assert retrieve(protected_retriever, body, {"Authorization": "Bearer wrong"}).status_code == 401
    assert retrieve(protected_retriever, body, {"Authorization": TOKEN}).status_code == 401  # no scheme
    assert httpx.get(f"{protected_retriever}/health").status_code == 401
    ok = retrieve(protected_retriever, body, BEARER)
    assert ok.status_code == 200
    assert len(ok.json()["result"][0]) == 2
    assert retrieve(protected_retriever, body, {"Authorization": f"bearer {TOKEN}"}).status_code == 200


def test_search_tool_sends_the_token_from_the_environment(protected_retriever, question, monkeypatch) -> None:
    monkeypatch.setenv(RETRIEVER_TOKEN_ENV, TOKEN)
    registry = search_registry(protected_retriever)
    (result,) = registry.run([ToolCall("search", question)])
    registry.close()
    assert result.ok and len(result.documents) == 2


def test_search_without_the_token_is_an_error_result_that_says_what_to_set(
    protected_retriever, question, monkeypatch
) -> None:
    monkeypatch.delenv(RETRIEVER_TOKEN_ENV, raising=False)
    registry = search_registry(protected_retriever)
    results = registry.run([ToolCall("search", question), ToolCall("search", "river")])
    assert [r.error_kind for r in results] == [ErrorKind.TOOL_ERROR] * 2
    assert "HTTP 401: the server requires a bearer token: set RLSEARCH_RETRIEVER_TOKEN to it" in results[0].error
    # both calls in one request, not retried after a 401
    assert registry.stats() == {"requests": 1, "retries": 0, "failures": 1, "calls_out": 2, "paid_calls_out": 0}
    registry.close()

    monkeypatch.setenv(RETRIEVER_TOKEN_ENV, "wrong")
    registry = search_registry(protected_retriever)
    (result,) = registry.run([ToolCall("search", question)])
    registry.close()
    assert "refused the bearer token in RLSEARCH_RETRIEVER_TOKEN" in result.error


def test_oversize_body_is_413(protected_retriever) -> None:
    big = {"queries": ["river " * 200] * 1000, "topk": 1}  # about 1.2 MB
    response = retrieve(protected_retriever, big, BEARER)
    assert response.status_code == 413
    assert "limit of 1048576 bytes" in response.json()["detail"]

    def chunks():  # no Content-Length: the guard counts what arrives
        for _ in range(300):
            yield b"x" * 4096

    chunked = retrieve(protected_retriever, None, BEARER, content=chunks())
    assert chunked.status_code == 413
    assert "over this server's limit of 1048576 bytes" in chunked.json()["detail"]
    # the token is checked first: a stranger learns nothing about the limits
    assert retrieve(protected_retriever, big).status_code == 401


@pytest.mark.parametrize(
    ("body", "limit"),
    [
        ({"queries": ["river"] * (MAX_QUERIES + 1)}, f"max_queries={MAX_QUERIES}"),
        ({"queries": ["river", "x" * (MAX_QUERY_CHARS + 1)]}, f"queries[1] has {MAX_QUERY_CHARS + 1} characters"),
        ({"queries": ["river"], "topk": MAX_TOPK + 1}, f"max_topk={MAX_TOPK}"),
    ],
)
def test_requests_over_a_limit_are_422_naming_it(protected_retriever, body, limit) -> None:
    response = retrieve(protected_retriever, body, BEARER)
    assert response.status_code == 422
    assert limit in response.json()["detail"]


def test_limits_are_configurable_and_no_token_means_open(bm25, monkeypatch) -> None:
    monkeypatch.delenv(RETRIEVER_TOKEN_ENV, raising=False)
    app = create_app(bm25, RequestLimits(max_body_bytes=200, max_queries=2, max_query_chars=10, max_topk=3))
    assert not app.requires_token
    with serve_in_thread(app) as url:
        assert retrieve(url, {"queries": ["river", "town"], "topk": 3}).status_code == 200
        assert "max_queries=2" in retrieve(url, {"queries": ["a", "b", "c"]}).json()["detail"]
        assert "max_query_chars=10" in retrieve(url, {"queries": ["river town x"]}).json()["detail"]
        assert "max_topk=3" in retrieve(url, {"queries": ["river"], "topk": 4}).json()["detail"]
        assert retrieve(url, {"queries": ["river " * 40]}).status_code == 413


def test_client_batches_stay_within_the_server_limit(protected_retriever, monkeypatch) -> None:
    monkeypatch.setenv(RETRIEVER_TOKEN_ENV, TOKEN)
    client = RetrievalClient(protected_retriever, topk=1, batch_size=10_000)
    assert client.batch_size == MAX_QUERIES
    results = client.search(["river"] * (MAX_QUERIES + 10))
    assert len(results) == MAX_QUERIES + 10 and client.num_requests == 2
    # a query over the server's length limit fails alone, not the turn's whole batch
    tool = SearchTool(client)
    long_query, fine = tool.run_batch([ToolCall("search", "x" * (MAX_QUERY_CHARS + 1)), ToolCall("search", "river")])
    tool.close()
    assert long_query.error == f"tool 'search': the query is longer than {MAX_QUERY_CHARS} characters"
    assert fine.ok


def test_mcp_client_with_the_token_lists_and_searches(protected_mcp, question, monkeypatch) -> None:
    monkeypatch.setenv(MCP_TOKEN_ENV, TOKEN)
    toolset = MCPToolset([MCPServerSpec(protected_mcp)], timeout_s=10, max_retries=1, backoff_s=0.05)
    try:
        tools = {tool.spec.name: tool for tool in toolset.tools}
        assert sorted(tools) == ["browse", "search"]
        (result,) = tools["search"].run_batch([ToolCall("search", question, {"topk": "2"})])
        assert result.ok and len(result.documents) == 2
        # the token variable is per server: the config's token_env reaches the client
        registry = build_registry(
            ToolsConfig(enabled=[], mcp=MCPConfig(servers=[MCPServerConfig(url=protected_mcp, allow=["search"])])),
            RetrieverConfig(), "",
        )
        assert registry.run([ToolCall("search", question)])[0].ok
        registry.close()

        # a connection whose token stops being accepted: the call fails at once with what to set, no retries
        monkeypatch.setenv(MCP_TOKEN_ENV, "wrong")
        search = tools["search"]
        toolset._runner.run(search.connection.reset())
        (refused,) = search.run_batch([ToolCall("search", question)])
        assert refused.error_kind is ErrorKind.TOOL_ERROR
        assert "refused the request: HTTP 401: the server refused the bearer token in RLSEARCH_MCP_TOKEN" in (
            refused.error
        )
        assert search.stats() == {"requests": 2, "retries": 0, "failures": 1}
    finally:
        toolset.close()


@pytest.mark.parametrize(
    ("token", "message"),
    [
        (None, "HTTP 401: the server requires a bearer token: set RLSEARCH_MCP_TOKEN to it"),
        ("wrong", "HTTP 401: the server refused the bearer token in RLSEARCH_MCP_TOKEN"),
    ],
)
def test_mcp_client_without_the_right_token_is_a_clear_setup_error(protected_mcp_server, monkeypatch, token,
                                                                    message):
    url, responses = protected_mcp_server
    if token is None:
        monkeypatch.delenv(MCP_TOKEN_ENV, raising=False)
    else:
        monkeypatch.setenv(MCP_TOKEN_ENV, token)

    def requests_refused(max_retries: int) -> list[tuple[str, int]]:
        before = len(responses.responses)
        with pytest.raises(ToolSetupError, match=f"cannot list the tools of MCP server {url}: {message}"):
            MCPToolset([MCPServerSpec(url)], timeout_s=10, max_retries=max_retries, backoff_s=0.05)
        return responses.responses[before:]

    one_attempt = requests_refused(max_retries=0)
    assert one_attempt and {status for _, status in one_attempt} == {401}
    assert requests_refused(max_retries=3) == one_attempt  # not retried: it would be refused again


def test_mcp_server_refusals_are_jsonrpc_errors(protected_mcp) -> None:
    ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
    headers = {"Accept": "application/json, text/event-stream"}
    refused = httpx.post(protected_mcp, json=ping, headers=headers)
    assert refused.status_code == 401
    assert refused.json()["error"]["message"].startswith("this server requires a bearer token")
    big = {**ping, "params": {"padding": "x" * (1 << 20)}}
    too_large = httpx.post(protected_mcp, json=big, headers={**headers, **BEARER})
    assert too_large.status_code == 413
    assert "over this server's limit of 1048576 bytes" in too_large.json()["error"]["message"]


def test_trainer_started_retriever_inherits_the_token(toy_data, tmp_path, question, monkeypatch) -> None:
    monkeypatch.setenv(RETRIEVER_TOKEN_ENV, TOKEN)
    config = ToolsConfig(retriever=RetrieverConfig(corpus=str(toy_data.corpus), index_cache_dir=str(tmp_path)))
    with ToolServers(config) as servers:  # its health check passes only with the token
        url = servers.retriever_url
        assert url.startswith("http://127.0.0.1:")
        assert retrieve(url, {"queries": [question]}).status_code == 401
        registry = build_registry(servers.tools, servers.tools.retriever, url)
        assert registry.run([ToolCall("search", question)])[0].ok
        registry.close()


def test_servers_bind_loopback_by_default_and_warn_when_exposed_without_a_token() -> None:
    parser = build_parser()
    retriever_args = parser.parse_args(["serve-retriever", "--corpus", "c.jsonl"])
    mcp_args = parser.parse_args(["serve-mcp", "--corpus", "c.jsonl", "--token-env", "MY_TOKEN"])
    assert (retriever_args.host, retriever_args.token_env, retriever_args.max_body_bytes) == (
        "127.0.0.1", RETRIEVER_TOKEN_ENV, 1 << 20
    )
    assert (retriever_args.max_queries, retriever_args.max_query_chars, retriever_args.max_topk) == (
        MAX_QUERIES, MAX_QUERY_CHARS, MAX_TOPK
    )
    assert (mcp_args.host, mcp_args.token_env) == ("127.0.0.1", "MY_TOKEN")
    for command in ("serve-retriever", "serve-mcp"):
        help_text = " ".join(parser._subparsers._group_actions[0].choices[command].format_help().split())
        assert "Authorization: Bearer <token>" in help_text and "--token-env NAME" in help_text

    assert all(is_loopback(host) for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"))
    assert not any(is_loopback(host) for host in ("0.0.0.0", "::", "10.1.2.3", "example.org"))
    open_app = ServiceGuard(None, token_env=RETRIEVER_TOKEN_ENV)
    assert exposure_warning("127.0.0.1", open_app) is None
    assert exposure_warning("0.0.0.0", ServiceGuard(None, token=TOKEN)) is None
    warning = exposure_warning("0.0.0.0", open_app)
    assert warning.startswith("WARNING: listening on 0.0.0.0 without a bearer token")
    assert RETRIEVER_TOKEN_ENV in warning


def test_ray_auth_is_disabled_only_for_the_local_instance() -> None:
    assert ray_env_defaults("")["RAY_AUTH_MODE"] == "disabled"
    assert "RAY_AUTH_MODE" not in ray_env_defaults("ray://head:10001")
    assert "RAY_AUTH_MODE" not in ray_env_defaults("10.0.0.5:6379")
