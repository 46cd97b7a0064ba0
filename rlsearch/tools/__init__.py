"""Tools for search agents: tool-call protocols (Search-R1, DR Tulu's call_tool), the tool registry, the retrieval
server and client, MCP client and server, browse with an SSRF guard, web search/reader adapters, a result cache."""

from __future__ import annotations

import importlib
from typing import Any

from rlsearch.tools.base import (
    Document,
    ErrorKind,
    ParsedTurn,
    Tool,
    ToolCall,
    ToolError,
    ToolResult,
    ToolSetupError,
    ToolSpec,
    ToolTimeout,
    TurnKind,
)
from rlsearch.tools.cache import ToolCache
from rlsearch.tools.call_tool import CallToolProtocol
from rlsearch.tools.client import RetrievalClient, SearchTool
from rlsearch.tools.protocol import SearchR1Protocol, ToolProtocol
from rlsearch.tools.registry import ToolRegistry
from rlsearch.tools.server_process import MCPServerProcess, RetrieverProcess
from rlsearch.tools.toolbox import PROTOCOLS, ToolServers, build_registry, make_protocol

# The server side pulls in bm25s, fastapi and mcp (a second or more to import); load it only when used, so
# rollout workers that just parse turns and call the tools stay light.
_LAZY_NAMES = {
    "BM25Retriever": "rlsearch.tools.retrieval",
    "build_retriever": "rlsearch.tools.retrieval",
    "create_app": "rlsearch.tools.retrieval",
    "serve_retriever": "rlsearch.tools.retrieval",
    "create_mcp_server": "rlsearch.tools.mcp_server",
    "serve_mcp": "rlsearch.tools.mcp_server",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "PROTOCOLS",
    "BM25Retriever",
    "CallToolProtocol",
    "Document",
    "ErrorKind",
    "MCPServerProcess",
    "ParsedTurn",
    "RetrievalClient",
    "RetrieverProcess",
    "SearchR1Protocol",
    "SearchTool",
    "Tool",
    "ToolCache",
    "ToolCall",
    "ToolError",
    "ToolProtocol",
    "ToolRegistry",
    "ToolResult",
    "ToolServers",
    "ToolSetupError",
    "ToolSpec",
    "ToolTimeout",
    "TurnKind",
    "build_registry",
    "build_retriever",
    "create_app",
    "create_mcp_server",
    "make_protocol",
    "serve_mcp",
    "serve_retriever",
]
