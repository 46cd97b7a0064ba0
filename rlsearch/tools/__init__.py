"""Tools for search agents, by what runs where:

- ``protocols/``: tag formats (Search-R1, DR Tulu's call_tool): prompts, turn parsing, observation text;
- ``clients/``: the tools the agent calls, in the rollout process (retrieval, MCP, browse, web search and
  reader), the registry that dispatches calls, the result cache;
- ``servers/``: the tool servers, each run as its own process (retrieval, MCP);
- ``launch/``: starting and stopping those servers for a run.

``base.py`` holds the plain data they share (calls, results, documents, error kinds).
"""

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
from rlsearch.tools.clients import ReplayMissError, RetrievalClient, SearchTool, ToolCache, ToolRegistry, build_registry
from rlsearch.tools.launch import MCPServerProcess, RetrieverProcess, ToolServers
from rlsearch.tools.protocols import PROTOCOLS, CallToolProtocol, SearchR1Protocol, ToolProtocol, make_protocol

# The servers pull in bm25s, fastapi and mcp (a second or more to import); load them only when used, so
# rollout workers that just parse turns and call the tools stay light.
_LAZY_NAMES = {
    "BM25Retriever": "rlsearch.tools.servers.retrieval",
    "CorpusIndex": "rlsearch.tools.servers.retrieval",
    "build_retriever": "rlsearch.tools.servers.retrieval",
    "create_app": "rlsearch.tools.servers.retrieval",
    "serve_retriever": "rlsearch.tools.servers.retrieval",
    "create_mcp_server": "rlsearch.tools.servers.mcp",
    "serve_mcp": "rlsearch.tools.servers.mcp",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "PROTOCOLS",
    "BM25Retriever",
    "CallToolProtocol",
    "CorpusIndex",
    "Document",
    "ErrorKind",
    "MCPServerProcess",
    "ParsedTurn",
    "ReplayMissError",
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
