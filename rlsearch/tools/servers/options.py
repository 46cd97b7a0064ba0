"""The command-line options of the tool servers (``serve-retriever``, ``serve-mcp``), shared with ``rlsearch``'s CLI."""

from __future__ import annotations

import argparse

from ..http import DEFAULT_MAX_BODY_BYTES, MCP_TOKEN_ENV, RETRIEVER_TOKEN_ENV
from ..search_api import MAX_QUERIES, MAX_QUERY_CHARS, MAX_TOPK

BACKENDS = ("bm25", "dense", "hybrid")


def add_retriever_arguments(parser: argparse.ArgumentParser) -> None:
    """The corpus and index options of the tool servers (``serve-retriever``, ``serve-mcp``), minus ``--port``."""
    parser.add_argument("--corpus", "--corpus_path", dest="corpus", required=True,
                        help='JSONL corpus, one {"id", "contents"} object per line')
    parser.add_argument("--backend", default=None, choices=BACKENDS,
                        help="bm25 (default), dense or hybrid (BM25 + dense by rank fusion); --index implies dense")
    parser.add_argument("--encoder", default="", help="sentence-transformers dir for dense/hybrid (default MiniLM)")
    parser.add_argument("--cache-dir", default=None, help="where indexes and embeddings are kept for reuse")
    parser.add_argument(
        "--host", default="127.0.0.1",
        help="bind address (default: loopback only); another address without a token prints a warning",
    )


def add_retriever_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option of ``serve-retriever`` (``python -m rlsearch.tools.servers.retrieval``). Search-R1's
    retrieval_server.py flags are accepted as aliases, so its command line works as it is."""
    add_retriever_arguments(parser)
    add_prebuilt_index_arguments(parser)
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--topk", type=_positive_int, default=3,
                        help="passages for a request that gives no topk (default: 3)")
    add_access_arguments(parser, RETRIEVER_TOKEN_ENV)
    add_retrieval_limit_arguments(parser)


def add_prebuilt_index_arguments(parser: argparse.ArgumentParser) -> None:
    """A prebuilt FAISS index and how its encoder embeds queries (Search-R1's names as aliases)."""
    parser.add_argument(
        "--index", "--index_path", dest="index", default="",
        help="a prebuilt FAISS index whose rows are the corpus lines (e.g. Search-R1's e5_Flat.index); searched with "
        "--encoder's query embeddings, the corpus read per hit",
    )
    # Search-R1's name for the encoder; --encoder itself is a shared option
    parser.add_argument("--retriever_model", dest="encoder", help=argparse.SUPPRESS)
    parser.add_argument(
        "--encoder-family", "--retriever_name", dest="encoder_family", default="",
        help="with --index: e5, bge, contriever, jina, dpr or another name; picks the query prefix, the pooling and "
        "the normalisation as Search-R1 does (default: from the encoder's name)",
    )
    parser.add_argument("--pooling", "--pooling_method", dest="pooling", default="auto",
                        choices=("auto", "mean", "cls", "pooler"),
                        help="with --index: how token states become a vector (default auto: the family's)")
    parser.add_argument("--query-prefix", dest="query_prefix", default=None,
                        help="with --index: text put before each query (default: the family's, e.g. 'query: ' for e5)")
    parser.add_argument("--faiss-gpu", "--faiss_gpu", dest="faiss_gpu", action="store_true",
                        help="with --index: search on the GPUs where faiss can put the index (Flat, IVF; not HNSW) and "
                        "has GPU support (else on the CPU, said)")
    parser.add_argument("--nprobe", type=_positive_int, default=0,
                        help="with an IVF --index: inverted lists searched per query (default: the index file's; "
                        "faiss's default 1 finds a fraction of what a Flat index finds); said at start-up")
    parser.add_argument("--efSearch", type=_positive_int, default=0,
                        help="with an HNSW --index: candidates kept while searching the graph (default: the index "
                        "file's, faiss's default 16); said at start-up")
    parser.add_argument("--encoder-device", default="auto",
                        help="with --index: where the encoder runs: auto (a GPU when one is visible, default), cpu, "
                        "cuda or cuda:N")


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


def run_server(description: str, add_arguments, serve_from_args) -> None:
    """A tool server's ``python -m``: its options (``add_arguments``) read from the command line, then served."""
    parser = argparse.ArgumentParser(description=description)
    add_arguments(parser)
    serve_from_args(parser.parse_args())


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value
