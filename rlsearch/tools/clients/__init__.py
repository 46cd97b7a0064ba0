"""The tools the agent calls, in the rollout process, and the registry that dispatches its calls to them."""

from __future__ import annotations

from .build import build_registry
from .cache import ReplayMissError, ToolCache
from .registry import ToolRegistry
from .retrieval import RetrievalClient, SearchTool

__all__ = ["ReplayMissError", "RetrievalClient", "SearchTool", "ToolCache", "ToolRegistry", "build_registry"]
