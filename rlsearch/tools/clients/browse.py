"""``browse``: fetch a web page for the model, safely; with a browse agent, a summariser model reads it for the model.

Only http and https. The host is resolved first and every address is checked: loopback, private, link-local
(which holds the cloud metadata endpoint 169.254.169.254), multicast, reserved and unspecified addresses are
refused unless their network is listed in ``allow_networks``. The connection then goes to the checked address
(so a second DNS answer cannot swap it), redirects are followed by hand and each hop is checked the same way,
and the body is cut at ``max_bytes`` and the whole fetch at ``timeout_s``.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html.parser import HTMLParser
from urllib.parse import urljoin, urlsplit, urlunsplit

import httpx

from ...config.prompt import PromptFile
from ..base import Document, PerCallTool, ToolCall, ToolError, ToolSpec, ToolTimeout
from .summarise import Summariser

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], list[str]]
BROWSE_DESCRIPTION = "fetch a web page and read its text; the query is the page's http(s) URL"
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(address) for address in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200")
)
_REDIRECTS = (301, 302, 303, 307, 308)
_SKIPPED_HTML = ("script", "style", "noscript", "template")


class BlockedURL(ToolError):
    """The URL may not be fetched (scheme, or an address that is not public)."""


def resolve_host(host: str, port: int) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ToolError(f"cannot resolve host {host!r}: {error}") from error
    return sorted({info[4][0] for info in infos})


class URLGuard:
    def __init__(self, allow_networks: Sequence[str] = (), resolve: Resolver = resolve_host) -> None:
        self.allow_networks = [ipaddress.ip_network(network, strict=False) for network in allow_networks]
        self.resolve = resolve

    def check(self, url: str) -> list[IPAddress]:
        """The addresses ``url`` may be fetched from; raises BlockedURL when any of them is refused."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise BlockedURL(f"only http and https URLs can be browsed; got {parts.scheme or 'no scheme'}: {url}")
        if not parts.hostname:
            raise BlockedURL(f"the URL has no host: {url}")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as error:
            raise BlockedURL(f"bad port in {url}: {error}") from error
        addresses = [ipaddress.ip_address(address.split("%")[0]) for address in self.resolve(parts.hostname, port)]
        if not addresses:
            raise ToolError(f"host {parts.hostname!r} has no address")
        for address in addresses:
            reason = self.refusal(address)
            if reason:
                raise BlockedURL(f"{url} resolves to {address}, a {reason} address; browsing it is not allowed")
        return addresses

    def refusal(self, address: IPAddress) -> str | None:
        """Why this address is refused, or None when it may be fetched."""
        if any(address in network for network in self.allow_networks):
            return None
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            return self.refusal(address.ipv4_mapped)
        checks = (
            (address in METADATA_ADDRESSES, "cloud metadata"),
            (address.is_loopback, "loopback"),
            (address.is_link_local, "link-local"),
            (address.is_private, "private"),
            (address.is_multicast, "multicast"),
            (address.is_unspecified or address.is_reserved or not address.is_global, "reserved"),
        )
        return next((reason for refused, reason in checks if refused), None)


@dataclass
class Page:
    url: str
    title: str
    text: str
    truncated: bool


class SafeFetcher:
    def __init__(
        self, guard: URLGuard, timeout_s: float = 10.0, max_bytes: int = 2_000_000, max_redirects: int = 3
    ) -> None:
        self.guard = guard
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.max_redirects = max_redirects
        self._http = httpx.Client(timeout=timeout_s, follow_redirects=False)

    def fetch(self, url: str) -> Page:
        deadline = time.monotonic() + self.timeout_s
        for _ in range(self.max_redirects + 1):
            address = self.guard.check(url)[0]
            try:
                status, location, body, truncated = self._get(url, address, deadline)
            except httpx.TimeoutException as error:
                raise ToolTimeout(f"fetching {url} timed out after {self.timeout_s:g} s") from error
            except httpx.HTTPError as error:
                raise ToolError(f"fetching {url} failed: {type(error).__name__}: {error}") from error
            if status in _REDIRECTS and location:
                url = urljoin(url, location)
                continue
            if status >= 400:
                raise ToolError(f"fetching {url} failed: HTTP {status}")
            title, text = html_to_text(body.decode("utf-8", errors="replace"))
            return Page(url=url, title=title, text=text, truncated=truncated)
        raise ToolError(f"more than {self.max_redirects} redirects; last location {url}")

    def close(self) -> None:
        self._http.close()

    def _get(self, url: str, address: IPAddress, deadline: float) -> tuple[int, str, bytes, bool]:
        """GET from the checked address with the URL's host name in Host (and in TLS SNI for https)."""
        parts = urlsplit(url)
        host = f"[{address}]" if address.version == 6 else str(address)
        pinned = urlunsplit(parts._replace(netloc=f"{host}:{parts.port}" if parts.port else host))
        headers = {"Host": parts.netloc.rpartition("@")[2], "User-Agent": "rlsearch-browse/0.1"}
        request = self._http.build_request("GET", pinned, headers=headers, extensions={"sni_hostname": parts.hostname})
        response = self._http.send(request, stream=True)
        try:
            if response.status_code in _REDIRECTS:
                return response.status_code, response.headers.get("location", ""), b"", False
            body = bytearray()
            for chunk in response.iter_bytes():
                body.extend(chunk)
                if len(body) > self.max_bytes:
                    return response.status_code, "", bytes(body[: self.max_bytes]), True
                if time.monotonic() > deadline:
                    raise ToolTimeout(f"fetching {url} took longer than {self.timeout_s:g} s")
            return response.status_code, "", bytes(body), False
        finally:
            response.close()


class _TextExtractor(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.title = ""
        self.parts: list[str] = []
        self._skipping = 0
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in _SKIPPED_HTML:
            self._skipping += 1
        elif tag == "title":
            self._in_title = True

    def handle_endtag(self, tag: str) -> None:
        if tag in _SKIPPED_HTML and self._skipping:
            self._skipping -= 1
        elif tag == "title":
            self._in_title = False

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data
        elif not self._skipping:
            self.parts.append(data)


def html_to_text(html: str) -> tuple[str, str]:
    """(title, visible text with runs of whitespace collapsed); plain text passes through."""
    extractor = _TextExtractor()
    extractor.feed(html)
    extractor.close()
    return " ".join(extractor.title.split()), " ".join(" ".join(extractor.parts).split())


def url_parameters() -> dict:
    """The JSON schema of a tool whose only parameter is a page's ``url`` (a native call's; a tag call's query)."""
    return {"type": "object", "properties": {"url": {"type": "string", "description": "the page's http(s) URL"}},
            "required": ["url"]}


@dataclass
class BrowseAgent:
    """A summariser that reads each fetched page for the policy: ``prompt`` (a PromptFile with {question}, {query},
    {page}) filled with the trajectory's question, the URL and the page's first ``max_page_chars``."""

    summariser: Summariser
    prompt: PromptFile
    max_page_chars: int = 6000


class BrowseTool(PerCallTool):
    """``browse``: the page's text, or with ``agent`` the summary its summariser writes of it (the question is then
    part of each call's identity: the tool store keeps a summary per question and URL)."""

    def __init__(self, fetcher: SafeFetcher, max_chars: int = 8000, max_concurrency: int = 4,
                 agent: BrowseAgent | None = None) -> None:
        spec = ToolSpec("browse", BROWSE_DESCRIPTION, url_parameters(), reads_question=agent is not None)
        super().__init__(spec, max_concurrency)
        self.fetcher = fetcher
        self.max_chars = max_chars
        self.agent = agent

    def call(self, call: ToolCall) -> list[Document]:
        page = self.fetcher.fetch(call.query.strip())
        if self.agent is not None:
            text = f"{page.title}\n{page.text[: self.agent.max_page_chars]}".strip()
            prompt = self.agent.prompt.render(question=call.question, query=call.query.strip(), page=text)
            summary = self.agent.summariser.summarise(prompt)
            return [Document(text=summary, title=page.title, url=page.url, kind="webpage")]
        text = page.text[: self.max_chars]
        if page.truncated or len(page.text) > self.max_chars:
            text += " ..."
        return [Document(text=text, title=page.title, url=page.url, kind="webpage")]

    def stats(self) -> dict[str, int]:
        return self.agent.summariser.stats() if self.agent is not None else {}

    def close(self) -> None:
        super().close()
        self.fetcher.close()
        if self.agent is not None:
            self.agent.summariser.close()
