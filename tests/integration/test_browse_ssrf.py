"""The browse tool's SSRF guard and limits, against a real HTTP server on 127.0.0.1.

No request ever leaves the machine: refused addresses are refused before any connection is made.
"""

import asyncio
import time

import pytest
from starlette.applications import Starlette
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, StreamingResponse
from starlette.routing import Route
from threaded_server import serve_in_thread

from rlsearch.tools import ErrorKind, ToolCall, ToolError
from rlsearch.tools.clients.browse import BlockedURL, BrowseTool, SafeFetcher, URLGuard, html_to_text

PAGE = "<html><head><title>Velmora</title><style>p{}</style></head><body><p>Velmora is a <b>town</b>.</p>" \
       "<script>alert(1)</script></body></html>"


SLOW_BODY_S = 60.0  # a body trickled out over a minute: a fetch cut at its 2 s limit ends long before it does
FETCH_LIMIT_S = 2.0


async def slow_body(request):
    async def chunks():
        for _ in range(int(SLOW_BODY_S / 0.1)):
            if await request.is_disconnected():  # the fetch gave up: the server can stop at the module's end
                return
            yield b"x" * 10
            await asyncio.sleep(0.1)

    return StreamingResponse(chunks(), media_type="text/plain")


ROUTES = [
    Route("/page", lambda _: HTMLResponse(PAGE)),
    Route("/big", lambda _: PlainTextResponse("y" * 50_000)),
    Route("/slow", slow_body),
    Route("/to-metadata", lambda _: RedirectResponse("http://169.254.169.254/latest/meta-data/", status_code=302)),
    Route("/to-private", lambda _: RedirectResponse("http://10.0.0.7/admin", status_code=301)),
    Route("/to-page", lambda _: RedirectResponse("/page", status_code=307)),
    Route("/loop", lambda _: RedirectResponse("/loop", status_code=302)),
]


@pytest.fixture(scope="module")
def site():
    with serve_in_thread(Starlette(routes=ROUTES)) as url:
        yield url


LOOPBACK_ALLOWED = URLGuard(allow_networks=["127.0.0.0/8"])


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("file:///etc/passwd", "only http and https URLs can be browsed; got file"),
        ("ftp://example.org/x", "only http and https URLs can be browsed; got ftp"),
        ("gopher://127.0.0.1:70/", "got gopher"),
        ("http:///nohost", "the URL has no host"),
        ("http://127.0.0.1:8000/", "resolves to 127.0.0.1, a loopback address"),
        ("http://[::1]/", "resolves to ::1, a loopback address"),
        ("http://[::ffff:127.0.0.1]/", "a loopback address"),
        ("http://169.254.169.254/latest/meta-data/", "resolves to 169.254.169.254, a cloud metadata address"),
        ("http://169.254.10.1/", "a link-local address"),
        ("http://10.1.2.3/", "a private address"),
        ("http://192.168.0.1/", "a private address"),
        ("http://0.0.0.0/", "resolves to 0.0.0.0"),
        ("http://localhost:9/", "resolves to 127.0.0.1, a loopback address"),
    ],
)
def test_ssrf_guard_refuses_non_public_targets(url: str, message: str) -> None:
    with pytest.raises(BlockedURL) as refused:
        URLGuard().check(url)
    assert message in str(refused.value)


def test_ssrf_guard_resolves_the_hostname_before_checking() -> None:
    guard = URLGuard(resolve=lambda host, port: {"intranet.example": ["93.184.216.34", "10.0.0.5"]}[host])
    with pytest.raises(BlockedURL, match="resolves to 10.0.0.5, a private address"):
        guard.check("https://intranet.example/wiki")
    public = URLGuard(resolve=lambda host, port: ["93.184.216.34"])
    assert [str(a) for a in public.check("https://www.example.org/")] == ["93.184.216.34"]


def test_ssrf_guard_allows_explicitly_listed_networks() -> None:
    assert [str(a) for a in LOOPBACK_ALLOWED.check("http://127.0.0.1:1/")] == ["127.0.0.1"]
    with pytest.raises(BlockedURL, match="private"):
        LOOPBACK_ALLOWED.check("http://10.0.0.1/")


def test_ssrf_browse_fetches_an_allowed_page_as_text(site: str) -> None:
    fetcher = SafeFetcher(LOOPBACK_ALLOWED, timeout_s=5)
    page = fetcher.fetch(f"{site}/page")
    assert (page.title, page.text, page.truncated) == ("Velmora", "Velmora is a town .", False)
    redirected = fetcher.fetch(f"{site}/to-page")
    assert redirected.url == f"{site}/page" and redirected.title == "Velmora"


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/to-metadata", "resolves to 169.254.169.254, a cloud metadata address"),
        ("/to-private", "resolves to 10.0.0.7, a private address"),
    ],
)
def test_ssrf_redirect_into_a_refused_address_is_refused(site: str, path: str, message: str) -> None:
    with pytest.raises(BlockedURL, match=message):
        SafeFetcher(LOOPBACK_ALLOWED, timeout_s=5).fetch(f"{site}{path}")


def test_ssrf_default_guard_refuses_the_local_test_server_itself(site: str) -> None:
    with pytest.raises(BlockedURL, match="loopback"):
        SafeFetcher(URLGuard(), timeout_s=5).fetch(f"{site}/page")


def test_browse_limits_size_redirects_and_time(site: str) -> None:
    big = SafeFetcher(LOOPBACK_ALLOWED, timeout_s=5, max_bytes=1000).fetch(f"{site}/big")
    assert (len(big.text), big.truncated) == (1000, True)
    with pytest.raises(ToolError, match="more than 3 redirects"):
        SafeFetcher(LOOPBACK_ALLOWED, timeout_s=5, max_redirects=3).fetch(f"{site}/loop")
    started = time.monotonic()
    with pytest.raises(ToolError, match=f"took longer than {FETCH_LIMIT_S:g} s"):
        SafeFetcher(LOOPBACK_ALLOWED, timeout_s=FETCH_LIMIT_S).fetch(f"{site}/slow")
    seconds = time.monotonic() - started
    assert seconds < 10 * FETCH_LIMIT_S, f"hang guard: the fetch limited to {FETCH_LIMIT_S:g} s took {seconds:.0f} s"


def test_browse_tool_reports_refusals_as_tool_errors(site: str) -> None:
    tool = BrowseTool(SafeFetcher(LOOPBACK_ALLOWED, timeout_s=5), max_chars=10)
    ok, refused = tool.run_batch([ToolCall("browse", f" {site}/page "), ToolCall("browse", "file:///etc/passwd")])
    assert ok.documents[0].text == "Velmora is ..." and ok.documents[0].kind == "webpage"
    assert refused.error_kind is ErrorKind.TOOL_ERROR and "only http and https" in refused.error
    tool.close()


def test_html_to_text_skips_scripts_and_collapses_whitespace() -> None:
    assert html_to_text("<title> A  B </title><script>x</script>\n<p>one\n\n two</p>") == ("A B", "one two")
