"""Starting and stopping the local tool servers of a run (each a subprocess on 127.0.0.1)."""

from __future__ import annotations

from .local import ToolServers
from .process import MCPServerProcess, RetrieverProcess

__all__ = ["MCPServerProcess", "RetrieverProcess", "ToolServers"]
