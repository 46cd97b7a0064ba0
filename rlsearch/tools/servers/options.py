"""The command-line options of the tool servers (``serve-retriever``, ``serve-mcp``), shared with ``rlsearch``'s CLI."""

from __future__ import annotations

import argparse

from ..http import DEFAULT_MAX_BODY_BYTES, MCP_TOKEN_ENV, RETRIEVER_TOKEN_ENV
from ..search_api import MAX_QUERIES, MAX_QUERY_CHARS, MAX_TOPK

BACKENDS = ("bm25", "dense", "hybrid")


def add_retriever_arguments(parser: argparse.ArgumentParser) -> None:
    """The corpus and index options of the tool servers (``serve-retriever``, ``serve-mcp``), minus ``--port``."""
    parser.add_argument("--corpus", required=True, help='JSONL corpus, one {"id", "contents"} object per line')
    parser.add_argument("--backend", default="bm25", choices=BACKENDS, help="hybrid: BM25 + dense by rank fusion")
    parser.add_argument("--encoder", default="", help="sentence-transformers dir for dense/hybrid (default MiniLM)")
    parser.add_argument("--cache-dir", default=None, help="where indexes and embeddings are kept for reuse")
    parser.add_argument(
        "--host", default="127.0.0.1",
        help="bind address (default: loopback only); another address without a token prints a warning",
    )


def add_retriever_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option of ``serve-retriever`` (``python -m rlsearch.tools.servers.retrieval``)."""
    add_retriever_arguments(parser)
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    add_access_arguments(parser, RETRIEVER_TOKEN_ENV)
    add_retrieval_limit_arguments(parser)


def add_mcp_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option of ``serve-mcp`` (``python -m rlsearch.tools.servers.mcp``)."""
    add_retriever_arguments(parser)
    parser.add_argument("--port", type=int, default=8001, help="0 picks a free port")
    add_access_arguments(parser, MCP_TOKEN_ENV)
    parser.add_argument(
        "--transport", default="http", choices=("http", "stdio"),
        help="http: streamable HTTP at /mcp (default). stdio: JSON-RPC over stdin/stdout, for a client that starts "
        "the server itself (tools.mcp.servers: [{command: [...]}]); --host, --port and the token do not apply",
    )


def add_access_arguments(parser: argparse.ArgumentParser, default_token_env: str) -> None:
    """The bearer token and body-size options every tool server takes."""
    parser.add_argument(
        "--token-env", default=default_token_env, metavar="NAME",
        help=f"environment variable holding a bearer token (default: {default_token_env}). When it is set and "
        "non-empty, every request must send 'Authorization: Bearer <token>' (401 otherwise); rlsearch clients send "
        "it from the variable of the same name. Unset: no token is required. '' turns the check off",
    )
    parser.add_argument(
        "--max-body-bytes", type=_positive_int, default=DEFAULT_MAX_BODY_BYTES,
        help=f"larger request bodies are refused with 413 (default: {DEFAULT_MAX_BODY_BYTES})",
    )


def add_retrieval_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """The /retrieve request limits (a request over one gets 422 naming it)."""
    for flag, default, meaning in [
        ("--max-queries", MAX_QUERIES, "queries per request"),
        ("--max-query-chars", MAX_QUERY_CHARS, "characters per query"),
    ]:
        parser.add_argument(flag, type=_positive_int, default=default, help=f"{meaning} (default: {default})")
    parser.add_argument("--max-topk", type=_positive_int, default=MAX_TOPK, help=f"largest topk (default: {MAX_TOPK})")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value
