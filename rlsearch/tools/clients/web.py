"""Paid web tools: ``web_search`` (Serper's Google search API) and ``web_browse`` (Jina's reader API).

Each needs its API key in an environment variable and refuses to start without it, naming the variable. The
endpoints are configurable (tests point them at a local server that speaks the same HTTP API).
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

import httpx

from ..base import Document, PerCallTool, ToolCall, ToolError, ToolSetupError, ToolSpec
from ..http import send_with_retries
from .browse import BlockedURL, url_parameters

WEB_SEARCH_DESCRIPTION = "search the web (Google via Serper); the query is a search query, results are snippets"
WEB_BROWSE_DESCRIPTION = "read a web page as text (via Jina Reader); the query is the page's http(s) URL"


def api_key(variable: str, tool: str) -> str:
    key = os.environ.get(variable, "").strip()
    if not key:
        raise ToolSetupError(
            f"tool '{tool}' needs an API key in the environment variable {variable}, which is not set; "
            f"export {variable}=... or remove '{tool}' from tools.enabled"
        )
    return key


class _WebTool(PerCallTool):
    """Shared HTTP plumbing: an authenticated client, retries, JSON bodies."""

    paid = True

    def __init__(
        self, spec: ToolSpec, url: str, headers: dict[str, str], timeout_s: float, max_retries: int,
        backoff_s: float, max_concurrency: int,
    ) -> None:
        super().__init__(spec, max_concurrency)
        self.url = url
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._http = httpx.Client(timeout=timeout_s, headers=headers)

    def _json(self, method: str, url: str, **kwargs) -> dict:
        response = send_with_retries(
            lambda: self._http.request(method, url, **kwargs), f"{self.spec.name} ({self.url})", self.max_retries,
            self.backoff_s, self.timeout_s,
        )
        try:
            body = response.json()
        except ValueError as error:
            raise ToolError(f"{self.spec.name}: the API returned invalid JSON: {error}") from error
        if not isinstance(body, dict):
            raise ToolError(f"{self.spec.name}: the API returned {type(body).__name__}, expected an object")
        return body

    def close(self) -> None:
        super().close()
        self._http.close()


class SerperSearchTool(_WebTool):
    """``POST {url}`` with ``{"q", "num"}`` and the ``X-API-KEY`` header; the ``organic`` hits become snippets."""

    def __init__(
        self, url: str, key: str, num_results: int = 5, timeout_s: float = 15.0, max_retries: int = 2,
        backoff_s: float = 0.5, max_concurrency: int = 4,
    ) -> None:
        super().__init__(
            ToolSpec("web_search", WEB_SEARCH_DESCRIPTION), url, {"X-API-KEY": key}, timeout_s, max_retries,
            backoff_s, max_concurrency,
        )
        self.num_results = num_results

    def call(self, call: ToolCall) -> list[Document]:
        body = self._json("POST", self.url, json={"q": call.query, "num": self.num_results})
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
        self, url: str, key: str, max_chars: int = 8000, timeout_s: float = 30.0, max_retries: int = 2,
        backoff_s: float = 0.5, max_concurrency: int = 4,
    ) -> None:
        headers = {"Authorization": f"Bearer {key}", "Accept": "application/json"}
        super().__init__(
            ToolSpec("web_browse", WEB_BROWSE_DESCRIPTION, url_parameters()), url, headers, timeout_s, max_retries,
            backoff_s, max_concurrency,
        )
        self.max_chars = max_chars

    def call(self, call: ToolCall) -> list[Document]:
        page_url = call.query.strip()
        if urlsplit(page_url).scheme not in ("http", "https"):
            raise BlockedURL(f"only http and https URLs can be read; got {page_url!r}")
        data = self._json("GET", self.url.rstrip("/") + "/" + page_url).get("data")
        if not isinstance(data, dict):
            raise ToolError("web_browse: the API's answer has no 'data' object")
        content = str(data.get("content", ""))
        text = content[: self.max_chars] + (" ..." if len(content) > self.max_chars else "")
        title, url = str(data.get("title", "")), str(data.get("url", page_url))
        return [Document(text=text, title=title, url=url, kind="webpage")]
