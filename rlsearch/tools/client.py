"""HTTP client for the retrieval server, with retries on transient failures."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import httpx


class ToolError(RuntimeError):
    """A tool call failed for good: a rejected request, or retries exhausted."""


class RetrievalClient:
    """Batched client for ``POST {url}/retrieve``.

    Counters: ``num_requests`` counts ``retrieve`` calls that went to the server, ``num_retries`` the
    extra attempts after transient failures, ``num_failures`` the calls that ended in ``ToolError``.
    """

    def __init__(
        self,
        url: str,
        topk: int = 3,
        timeout_s: float = 10.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
    ) -> None:
        self.url = url.rstrip("/")
        self.topk = topk
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.num_requests = 0
        self.num_retries = 0
        self.num_failures = 0
        self._http = httpx.Client(timeout=timeout_s)

    def retrieve(self, queries: Sequence[str]) -> list[list[str]]:
        """The ``contents`` of the top documents for each query, best first, in one request."""
        if not queries:
            return []
        self.num_requests += 1
        endpoint = f"{self.url}/retrieve"
        payload = {"queries": list(queries), "topk": self.topk, "return_scores": False}
        try:
            body = self._post_with_retries(endpoint, payload)
            return _contents_per_query(body, len(queries), endpoint)
        except ToolError:
            self.num_failures += 1
            raise

    def close(self) -> None:
        self._http.close()

    def _post_with_retries(self, endpoint: str, payload: dict) -> Any:
        last_error = ""
        for attempt in range(self.max_retries + 1):
            if attempt > 0:
                self.num_retries += 1
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                response = self._http.post(endpoint, json=payload)
            except httpx.TransportError as error:
                last_error = f"{type(error).__name__}: {error}"
                continue
            if response.status_code >= 500:
                last_error = f"HTTP {response.status_code}: {response.text[:200]}"
                continue
            if response.status_code >= 400:
                raise ToolError(f"{endpoint} rejected: HTTP {response.status_code} {response.text}")
            try:
                return response.json()
            except ValueError as error:
                raise ToolError(f"{endpoint} returned invalid JSON: {error}") from error
        raise ToolError(f"{endpoint} failed after {self.max_retries + 1} attempts; last error: {last_error}")


def _contents_per_query(body: Any, num_queries: int, endpoint: str) -> list[list[str]]:
    try:
        contents = [[document["contents"] for document in documents] for documents in body["result"]]
    except (KeyError, TypeError) as error:
        raise ToolError(f"{endpoint} returned an unexpected body: {error!r}") from error
    if len(contents) != num_queries:
        raise ToolError(f"{endpoint} returned {len(contents)} results for {num_queries} queries")
    return contents
