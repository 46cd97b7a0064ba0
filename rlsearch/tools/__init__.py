"""Tools for search agents: the Search-R1 protocol, a BM25 retrieval server, its client and launcher."""

from __future__ import annotations

import importlib
from typing import Any

from rlsearch.tools.client import RetrievalClient, ToolError
from rlsearch.tools.protocol import ParsedTurn, SearchR1Protocol, ToolCall, TurnKind
from rlsearch.tools.server_process import RetrieverProcess

# The server side pulls in bm25s and fastapi (about a second to import); load it only when used, so
# rollout workers that just parse turns and call the client stay light.
_LAZY_RETRIEVAL_NAMES = ("BM25Retriever", "create_app", "serve_retriever")


def __getattr__(name: str) -> Any:
    if name in _LAZY_RETRIEVAL_NAMES:
        return getattr(importlib.import_module("rlsearch.tools.retrieval"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BM25Retriever",
    "ParsedTurn",
    "RetrievalClient",
    "RetrieverProcess",
    "SearchR1Protocol",
    "ToolCall",
    "ToolError",
    "TurnKind",
    "create_app",
    "serve_retriever",
]
