"""Paid web tools: ``web_search`` (Serper's Google search API) and ``web_browse`` (Jina's reader API).

Each needs its API key in an environment variable and refuses to start without it, naming the variable. The
endpoints are configurable (tests point them at a local server that speaks the same HTTP API): a list of them is tried
in order with failover (`rlsearch.failover`), a dead one skipped for a cool-down and counted in ``failovers``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from ...config import EndpointConfig, JinaConfig, SerperConfig
from ...failover import Failover
from ..base import Document, PerCallTool, ToolCall, ToolError, ToolSpec
from ..http import api_key, send_with_failover
from .browse import BlockedURL, url_parameters

WEB_SEARCH_DESCRIPTION = "search the web (Google via Serper); the query is a search query, results are snippets"
WEB_BROWSE_DESCRIPTION = "read a web page as text (via Jina Reader); the query is the page's http(s) URL"


@dataclass(frozen=True, eq=False)
class WebEndpoint:
    url: str
    key: str = ""  # its API key; empty: none sent


def web_endpoints(section: SerperConfig | JinaConfig, tool: str) -> list[WebEndpoint]:
    """The section's endpoints (or its url and api_key_env as one), each with its key from the environment."""
    endpoints = section.endpoints or [EndpointConfig(section.url, api_key_env=section.api_key_env)]
    return [WebEndpoint(e.url, api_key(e.api_key_env, tool) if e.api_key_env else "") for e in endpoints]


class _WebTool(PerCallTool):
    """Shared HTTP plumbing: endpoints tried in order with failover, retries, JSON bodies."""

    paid = True

    def __init__(
        self, spec: ToolSpec, endpoints: Sequence[WebEndpoint], timeout_s: float, max_retries: int,
        backoff_s: float, max_concurrency: int, cooldown_s: float, deadline_s: float,
    ) -> None:
        super().__init__(spec, max_concurrency)
        self.endpoints = Failover(endpoints, cooldown_s)
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s  # of a call, over every endpoint and retry; 0: none
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._http = httpx.Client(timeout=timeout_s)

    @property
    def url(self) -> str:
        return self.endpoints.endpoints[0].url

    def _headers(self, endpoint: WebEndpoint) -> dict[str, str]:
        """The request headers of ``endpoint`` (its key)."""
        raise NotImplementedError

    def _json(self, method: str, target, **kwargs) -> dict:
        """The JSON object answered to ``method`` at ``target(endpoint)``, the first endpoint that answers."""
        where = self.url if len(self.endpoints.endpoints) == 1 else f"{len(self.endpoints.endpoints)} endpoints"
        response = send_with_failover(
            self._http,
            lambda endpoint: self._http.build_request(method, target(endpoint), headers=self._headers(endpoint),
                                                      **kwargs),
            self.endpoints, f"{self.spec.name} ({where})", self.max_retries, self.backoff_s, self.timeout_s,
            deadline_s=self.deadline_s,
        )
        try:
            body = response.json()
        except ValueError as error:
            raise ToolError(f"{self.spec.name}: the API returned invalid JSON: {error}") from error
        if not isinstance(body, dict):
            raise ToolError(f"{self.spec.name}: the API returned {type(body).__name__}, expected an object")
        return body

    def stats(self) -> dict[str, int]:
        return {"failovers": self.endpoints.failovers}

    def close(self) -> None:
        super().close()
        self._http.close()


class SerperSearchTool(_WebTool):
    """``POST {url}`` with ``{"q", "num"}`` and the ``X-API-KEY`` header; the ``organic`` hits become snippets."""

    def __init__(
        self, endpoints: Sequence[WebEndpoint], num_results: int = 5, timeout_s: float = 15.0, max_retries: int = 2,
        backoff_s: float = 0.5, max_concurrency: int = 4, cooldown_s: float = 30.0, deadline_s: float = 0.0,
    ) -> None:
        super().__init__(
            ToolSpec("web_search", WEB_SEARCH_DESCRIPTION), endpoints, timeout_s, max_retries, backoff_s,
            max_concurrency, cooldown_s, deadline_s,
        )
        self.num_results = num_results

    def _headers(self, endpoint: WebEndpoint) -> dict[str, str]:
        return {"X-API-KEY": endpoint.key} if endpoint.key else {}

    def call(self, call: ToolCall) -> list[Document]:
        body = self._json("POST", lambda endpoint: endpoint.url, json={"q": call.query, "num": self.num_results})
        hits = body.get("organic", [])
        if not isinstance(hits, list):
            raise ToolError("web_search: the API's 'organic' field is not a list")
        return [
            Document(text=str(hit.get("snippet", "")), title=str(hit.get("title", "")), url=str(hit.get("link", "")))
            for hit in hits[: self.num_results]
            if isinstance(hit, dict)
        ]


class JinaReaderTool(_WebTool):
    """``GET {url}{page URL}`` with a bearer key and ``Accept: application/json``; ``data.content`` is the page."""

    def __init__(
        self, endpoints: Sequence[WebEndpoint], max_chars: int = 8000, timeout_s: float = 30.0, max_retries: int = 2,
        backoff_s: float = 0.5, max_concurrency: int = 4, cooldown_s: float = 30.0, deadline_s: float = 0.0,
    ) -> None:
        super().__init__(
            ToolSpec("web_browse", WEB_BROWSE_DESCRIPTION, url_parameters()), endpoints, timeout_s, max_retries,
            backoff_s, max_concurrency, cooldown_s, deadline_s,
        )
        self.max_chars = max_chars

    def _headers(self, endpoint: WebEndpoint) -> dict[str, str]:
        return {"Accept": "application/json", **({"Authorization": f"Bearer {endpoint.key}"} if endpoint.key else {})}

    def call(self, call: ToolCall) -> list[Document]:
        page_url = call.query.strip()
        if urlsplit(page_url).scheme not in ("http", "https"):
            raise BlockedURL(f"only http and https URLs can be read; got {page_url!r}")
        data = self._json("GET", lambda endpoint: endpoint.url.rstrip("/") + "/" + page_url).get("data")
        if not isinstance(data, dict):
            raise ToolError("web_browse: the API's answer has no 'data' object")
        content = str(data.get("content", ""))
        text = content[: self.max_chars] + (" ..." if len(content) > self.max_chars else "")
        title, url = str(data.get("title", "")), str(data.get("url", page_url))
        return [Document(text=text, title=title, url=url, kind="webpage")]
