"""The browse agent's summariser over OpenAI-compatible endpoints (tools.browse.summariser.endpoints): the first dead,
the second a real HTTP chat server on 127.0.0.1 (judge_stub's); the summary is the tool's result, the question and the
page are in its prompt, the failover is counted, and every endpoint down is an error result, not a hang."""

from __future__ import annotations

import socket
import threading

import pytest
from starlette.applications import Starlette
from starlette.responses import HTMLResponse
from starlette.routing import Route
from threaded_server import serve_in_thread

from rlsearch.config import BrowseConfig, EndpointConfig, RetrieverConfig, SummariserConfig, ToolsConfig
from rlsearch.tools import ErrorKind, ToolCall, ToolTimeout, build_registry
from rlsearch.tools.clients.summarise import build_summariser
from tests.integration.judge_stub import Scripted, stub_judge, trickling_chat_server

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
    (result,) = registry.run([ToolCall("browse", site, question=QUESTION)])
    registry.close()
    assert result.error_kind is ErrorKind.TOOL_ERROR
    assert "browse summariser failed after 2 attempts over 2 endpoints" in result.error


def ended_within(seconds: float, call) -> Exception:
    """The error ``call()`` raised, on a thread given ``seconds`` to end (a hang guard far above what it needs)."""
    raised: list[Exception] = []

    def run() -> None:
        try:
            call()
        except Exception as error:  # handed to the test
            raised.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"hang guard: the call did not end within {seconds:g} s"
    assert raised, "the call returned an answer"
    return raised[0]


def test_a_summariser_that_trickles_bytes_is_cut_off_per_request_and_by_the_calls_deadline():
    """Two endpoints that answer 200 and then a space every 0.2 s forever: httpx's read timeout (a byte within
    timeout_s) never trips, so each request is held to timeout_s as a whole; and the call, over both endpoints and
    its retries, to deadline_s: a, b (1 s each), the retry after 0.5 s gets 1 s, the next backoff would pass 4 s."""
    with trickling_chat_server() as (trickler, url):
        endpoints = [EndpointConfig(f"{url}/a", "a"), EndpointConfig(f"{url}/b", "b")]
        per_request = build_summariser(SummariserConfig(endpoints=endpoints, timeout_s=1.0, max_retries=0))
        error = ended_within(30, lambda: per_request.summarise("a page"))
        assert isinstance(error, ToolTimeout) and str(error) == (
            "browse summariser failed after 2 attempts over 2 endpoints; last error: timed out after 1 s (ReadTimeout)")
        assert trickler.requests == 2 and trickler.bytes_sent >= 2
        bounded = build_summariser(SummariserConfig(endpoints=endpoints, timeout_s=1.0, max_retries=5, backoff_s=0.5,
                                                    deadline_s=4.0))
        error = ended_within(30, lambda: bounded.summarise("a page"))
        assert isinstance(error, ToolTimeout) and str(error).startswith(
            "browse summariser failed after 3 attempts over 2 endpoints and its deadline of 4 s passed; last error: "
            "timed out after"), error
        assert trickler.requests == 2 + 3
        per_request.close()
        bounded.close()
