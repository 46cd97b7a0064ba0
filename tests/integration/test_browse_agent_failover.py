"""The browse agent's summariser over OpenAI-compatible endpoints (tools.browse.summariser.endpoints): the first dead,
the second a real HTTP chat server on 127.0.0.1 (judge_stub's); the summary is the tool's result, the question and the
page are in its prompt, the failover is counted, and every endpoint down is an error result, not a hang."""

from __future__ import annotations

import socket
import time

import pytest
from starlette.applications import Starlette
from starlette.responses import HTMLResponse
from starlette.routing import Route
from threaded_server import serve_in_thread

from rlsearch.config import BrowseConfig, EndpointConfig, RetrieverConfig, SummariserConfig, ToolsConfig
from rlsearch.tools import ErrorKind, ToolCall, build_registry
from tests.integration.judge_stub import Scripted, stub_judge

QUESTION = "Who founded Velmora?"


@pytest.fixture(scope="module")
def site():
    page = HTMLResponse("<html><head><title>Velmora</title></head><body><p>Ada Brun founded it in 1702.</p></body>"
                        "</html>")
    with serve_in_thread(Starlette(routes=[Route("/{path:path}", lambda _: page)])) as url:
        yield f"{url}/velmora"


def dead_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}/v1"


def browse_tools(endpoints: list[EndpointConfig]) -> ToolsConfig:
    summariser = SummariserConfig(endpoints=endpoints, max_retries=0, timeout_s=2.0, cooldown_s=60.0)
    return ToolsConfig(enabled=["browse"], cache_dir="",
                       browse=BrowseConfig(allow_networks=["127.0.0.0/8"], summariser=summariser))


def test_browse_agent_fails_over_to_a_live_summariser_and_counts_it(site):
    with stub_judge(lambda prompt, attempt: Scripted("Ada Brun founded Velmora in 1702.")) as (stub, url):
        registry = build_registry(browse_tools([EndpointConfig(dead_url(), "summariser-a"),
                                                EndpointConfig(url, "summariser-b")]), RetrieverConfig(), "")
        first, second = (registry.run([ToolCall("browse", site, question=QUESTION)])[0] for _ in range(2))
        stats = registry.stats()
        registry.close()
    assert first.ok and [d.text for d in first.documents] == ["Ada Brun founded Velmora in 1702."]
    assert (first.documents[0].title, first.documents[0].kind) == ("Velmora", "webpage")
    assert second.documents == first.documents
    (prompt, _) = stub.prompts
    assert f"Question: {QUESTION}" in prompt and f"Page opened: {site}" in prompt
    assert "Velmora\nAda Brun founded it in 1702." in prompt
    # the dead endpoint was failed over once, then skipped while it cools down
    assert stats["summariser_calls"] == 2 and stats["failovers"] == 1


def test_browse_agent_with_every_summariser_down_is_an_error_result_not_a_hang(site):
    registry = build_registry(browse_tools([EndpointConfig(dead_url(), "a"), EndpointConfig(dead_url(), "b")]),
                              RetrieverConfig(), "")
    started = time.monotonic()
    (result,) = registry.run([ToolCall("browse", site, question=QUESTION)])
    registry.close()
    assert time.monotonic() - started < 5.0
    assert result.error_kind is ErrorKind.TOOL_ERROR
    assert "browse summariser failed after 2 attempts over 2 endpoints" in result.error
