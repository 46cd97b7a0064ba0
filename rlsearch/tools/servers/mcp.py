"""``rlsearch serve-mcp``: an MCP server (streamable HTTP at /mcp, or stdio) over the local corpus, fully offline.

Tools: ``search`` (the local retriever: BM25, dense or hybrid) and ``browse`` (a whole passage by the URL or id
that search results show). Results are structured items ``{id, title, url, text, kind}``, which the MCP client
renders as ``<snippet>`` / ``<webpage>`` items. When the token variable (``--token-env``, default
RLSEARCH_MCP_TOKEN) is set where the server starts, every request must carry ``Authorization: Bearer <token>``;
request bodies are bounded (413). With ``--transport stdio`` the server speaks JSON-RPC over its stdin/stdout
instead, for a client that starts it as a process (no network, no token).
"""

from __future__ import annotations

import argparse
import sys
from contextlib import redirect_stdout

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse

from ..http import DEFAULT_MAX_BODY_BYTES, MCP_TOKEN_ENV
from ..search_api import MAX_TOPK, SEARCH_DESCRIPTION
from .options import add_mcp_server_arguments, run_server
from .retrieval import CorpusIndex, Retriever
from .serving import ServiceGuard, guard, serve_app

LOCAL_URL_PREFIX = "local://corpus/"
BROWSE_DESCRIPTION = "read a whole document of the collection; the query is its URL (local://corpus/ID) or its ID"


class Item(BaseModel):
    """One result item; the MCP client renders it as a <snippet> or <webpage>."""

    id: str
    title: str
    url: str
    text: str
    kind: str  # snippet | webpage


def create_mcp_server(retriever: Retriever, default_topk: int = 3) -> MCPServer:
    server = MCPServer("rlsearch", instructions="Search and read the local document collection.")
    corpus = retriever.corpus

    @server.tool(name="search", description=SEARCH_DESCRIPTION)
    def search(query: str, topk: int = default_topk) -> list[Item]:
        if not 1 <= topk <= MAX_TOPK:
            raise ToolError(f"topk must be between 1 and {MAX_TOPK}; got {topk}")
        return [_item(document) for document, _ in retriever.search([query], topk)[0]]

    @server.tool(name="browse", description=BROWSE_DESCRIPTION)
    def browse(url: str) -> Item:
        document = corpus.find(url.strip().removeprefix(LOCAL_URL_PREFIX))
        if document is None:
            raise ToolError(f"no document at {url!r}; browse takes a URL or ID from search results")
        return _item(document, kind="webpage")

    @server.custom_route("/health", methods=["GET"])
    async def health(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "num_documents": len(corpus)})

    return server


def _item(document: dict, kind: str = "snippet") -> Item:
    title, _, body = document["contents"].partition("\n")
    doc_id = str(document["id"])
    return Item(id=doc_id, title=title, url=f"{LOCAL_URL_PREFIX}{doc_id}", text=body, kind=kind)


def serve_mcp(
    index: CorpusIndex,
    host: str = "127.0.0.1",
    port: int = 8001,
    token_env: str = MCP_TOKEN_ENV,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    transport: str = "http",
) -> None:
    """Serve the corpus of ``index`` over MCP until interrupted. ``port=0`` picks a free port (printed). When the
    variable ``token_env`` is set, requests need its token. ``transport="stdio"``: serve on stdin/stdout until stdin
    closes (host, port, token and body limit do not apply)."""
    if transport == "stdio":
        with redirect_stdout(sys.stderr):  # stdout carries the protocol: whatever indexing prints goes to stderr
            retriever = index.build()
        print(f"mcp server on stdio ({len(retriever.corpus)} documents, {index.describe()})", file=sys.stderr,
              flush=True)
        create_mcp_server(retriever).run("stdio")
        return
    retriever = index.build()
    app = create_mcp_app(retriever, host, token_env, max_body_bytes)
    secured = ", bearer token required" if app.requires_token else ""
    announcement = (
        f"mcp server listening on {{url}} (endpoint /mcp, {len(retriever.corpus)} documents, {index.describe()}"
        f"{secured})"
    )
    serve_app(app, host, port, announcement)


def create_mcp_app(
    retriever: Retriever,
    host: str = "127.0.0.1",
    token_env: str = MCP_TOKEN_ENV,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> ServiceGuard:
    """The streamable HTTP app (endpoint /mcp, and /health) behind the token check (the token is read from the
    variable ``token_env`` now; unset or "": none required) and the body-size bound."""
    # stateless: every request stands alone, so clients carry on across a server restart
    app = create_mcp_server(retriever).streamable_http_app(stateless_http=True, json_response=True, host=host)
    return guard(app, token_env, max_body_bytes, jsonrpc=True)


def serve_from_args(args: argparse.Namespace) -> None:
    """``serve_mcp`` with the options of ``add_mcp_server_arguments``."""
    serve_mcp(CorpusIndex.from_args(args), args.host, args.port, args.token_env, args.max_body_bytes, args.transport)


def main() -> None:
    run_server("Serve the local corpus over MCP (search, browse).", add_mcp_server_arguments, serve_from_args)


if __name__ == "__main__":
    main()
