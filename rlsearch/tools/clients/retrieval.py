"""HTTP client for the retrieval server: batched requests, bounded concurrency, retries on transient failures."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from ...failover import Failover
from ..base import Document, ErrorKind, Tool, ToolCall, ToolError, ToolResult, ToolSpec, query_parameters
from ..http import RETRIEVER_TOKEN_ENV, auth_hint, bearer_headers, send_with_failover
from ..search_api import MAX_QUERIES, MAX_QUERY_CHARS, MAX_TOPK, SEARCH_DESCRIPTION


class RetrievalClient:
    """Client for ``POST {url}/retrieve``.

    The queries of one ``retrieve``/``search`` call go out in requests of at most ``batch_size`` queries, at most
    ``max_concurrency`` of them in flight (httpx costs several ms of client CPU per request: few large requests beat
    many small ones). Counters: ``num_requests`` counts requests sent (not retries), ``num_retries`` the extra
    attempts after transient failures, ``num_failures`` the calls that ended in ``ToolError``.

    When the environment variable ``token_env`` holds a token, every request carries ``Authorization: Bearer
    <token>``; a 401/403 answer is not retried and its error says which variable to set.
    """

    def __init__(
        self,
        url: str,
        topk: int = 3,
        timeout_s: float = 10.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        batch_size: int = 64,
        max_concurrency: int = 4,
        token_env: str = RETRIEVER_TOKEN_ENV,
    ) -> None:
        self.url = url.rstrip("/")
        self.topk = topk
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.batch_size = min(batch_size, MAX_QUERIES)
        self.token_env = token_env
        self.num_requests = 0
        self.num_retries = 0
        self.num_failures = 0
        headers = bearer_headers(token_env)
        self._auth_hint = auth_hint(token_env, bool(headers), "tools.retriever.token_env")
        self._http = httpx.Client(timeout=timeout_s, headers=headers)
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="retrieval-client")
        self._counter_lock = threading.Lock()

    def retrieve(self, queries: Sequence[str]) -> list[list[str]]:
        """The ``contents`` of the top documents for each query, best first."""
        return [[document["contents"] for document in documents] for documents in self.search(queries)]

    def search(self, queries: Sequence[str], topk: int | None = None) -> list[list[dict]]:
        """The top ``{"id", "contents"}`` documents for each query, best first (``topk`` defaults to the client's)."""
        if not queries:
            return []
        topk = topk or self.topk
        chunks = [list(queries[i : i + self.batch_size]) for i in range(0, len(queries), self.batch_size)]
        try:
            if len(chunks) == 1:
                return self._search_chunk(chunks[0], topk)
            searched = self._pool.map(self._search_chunk, chunks, [topk] * len(chunks))
            return [documents for chunk in searched for documents in chunk]
        except ToolError:
            self._count("num_failures")
            raise

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def _search_chunk(self, queries: list[str], topk: int) -> list[list[dict]]:
        self._count("num_requests")
        endpoint = f"{self.url}/retrieve"
        body = self._post_with_retries(endpoint, {"queries": queries, "topk": topk, "return_scores": False})
        return _documents_per_query(body, len(queries), endpoint)

    def _count(self, counter: str) -> None:
        with self._counter_lock:
            setattr(self, counter, getattr(self, counter) + 1)

    def _post_with_retries(self, endpoint: str, payload: dict) -> Any:
        response = send_with_failover(
            self._http, lambda _: self._http.build_request("POST", endpoint, json=payload), Failover([endpoint]),
            endpoint, self.max_retries, self.backoff_s, self.timeout_s, on_retry=lambda: self._count("num_retries"),
            auth_hint=self._auth_hint,
        )
        try:
            return response.json()
        except ValueError as error:
            raise ToolError(f"{endpoint} returned invalid JSON: {error}", unavailable=True) from error


def _documents_per_query(body: Any, num_queries: int, endpoint: str) -> list[list[dict]]:
    """The ``{"id", "contents"}`` documents of each query in a /retrieve reply; a reply of another shape is the
    server's failure (ToolError, ``unavailable``), never a crash further on."""
    results = body.get("result") if isinstance(body, dict) else None
    if not isinstance(results, list):
        raise _malformed(endpoint, f"a {type(body).__name__} without a 'result' list")
    if len(results) != num_queries:
        raise _malformed(endpoint, f"{len(results)} results for {num_queries} queries")
    documents = []
    for query_index, docs in enumerate(results):
        if not isinstance(docs, list):
            raise _malformed(endpoint, f"result[{query_index}] is a {type(docs).__name__}, not a list")
        for doc_index, doc in enumerate(docs):
            where = f"result[{query_index}][{doc_index}]"
            if not isinstance(doc, dict) or not isinstance(doc.get("contents"), str):
                contents = doc.get("contents") if isinstance(doc, dict) else doc
                raise _malformed(endpoint, f"{where}.contents is {contents!r:.60}, not text")
            if not isinstance(doc.get("id", ""), (str, int)):
                raise _malformed(endpoint, f"{where}.id is {doc['id']!r:.60}, not text or a number")
        documents.append([{"id": doc.get("id", ""), "contents": doc["contents"]} for doc in docs])
    return documents


def _malformed(endpoint: str, what: str) -> ToolError:
    return ToolError(f"{endpoint} returned a malformed reply: {what}; Search-R1's /retrieve API answers "
                     '{"result": [[{"id": ..., "contents": "..."}, ...] per query]}', unavailable=True)


class SearchTool(Tool):
    """``search`` backed by the retrieval server: a turn's queries go out batched (one request per ``topk``).

    The only attribute is ``topk`` (1 to MAX_TOPK), as for the MCP server's search (a native call's typed
    arguments arrive as query and attributes, see ``ToolRegistry``). An empty query (a native call without one), or
    one longer than the server's default limit (MAX_QUERY_CHARS), gets an error result of its own instead of failing
    the batch.
    """

    def __init__(self, client: RetrievalClient) -> None:
        parameters = query_parameters("a short keyword query")
        parameters["properties"]["topk"] = {
            "type": "integer", "minimum": 1, "maximum": MAX_TOPK, "description": "how many passages to return",
        }
        self.spec = ToolSpec("search", SEARCH_DESCRIPTION, parameters)
        self.client = client

    def run_batch(self, calls: list[ToolCall]) -> list[ToolResult]:
        results: list[ToolResult | None] = [None] * len(calls)
        by_topk: dict[int, list[int]] = {}
        for index, call in enumerate(calls):
            try:
                if not call.query.strip():
                    raise ToolError("tool 'search': the query is empty")
                if len(call.query) > MAX_QUERY_CHARS:
                    raise ToolError(f"tool 'search': the query is longer than {MAX_QUERY_CHARS} characters")
                by_topk.setdefault(self._topk(call), []).append(index)
            except ToolError as error:
                results[index] = ToolResult.failure(ErrorKind.TOOL_ERROR, str(error))
        for topk, indices in by_topk.items():
            hits = self.client.search([calls[i].query for i in indices], topk)
            for index, documents in zip(indices, hits):
                passages = [Document.from_passage(doc["contents"], str(doc["id"])) for doc in documents]
                results[index] = ToolResult(documents=passages)
        return results

    def _topk(self, call: ToolCall) -> int:
        unknown = sorted(set(call.attrs) - {"topk"})
        if unknown:
            raise ToolError(f"tool 'search' has no parameter '{unknown[0]}'; it takes: query, topk")
        text = call.attrs.get("topk")
        if text is None:
            return self.client.topk
        if not text.isdigit() or not 1 <= int(text) <= MAX_TOPK:
            raise ToolError(f"tool 'search': topk must be an integer from 1 to {MAX_TOPK}; got {text!r}")
        return int(text)

    def stats(self) -> dict[str, int]:
        client = self.client
        return {"requests": client.num_requests, "retries": client.num_retries, "failures": client.num_failures}

    def close(self) -> None:
        self.client.close()

