"""Tool-call protocols, chosen by ``rollout.protocol``: the prompt, how a generated turn becomes an action, how tool
output is rendered. Text in, text out: nothing here talks to a tool."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ..base import ToolSetupError, ToolSpec
from .base import ANSWER_CLOSE, ANSWER_OPEN, PromptTemplate, ToolProtocol, TurnAction
from .call_tool import CallToolProtocol
from .chat_tools import ChatToolsProtocol
from .search_r1 import SearchR1Protocol

PROTOCOLS: dict[str, type[ToolProtocol]] = {
    "search_r1": SearchR1Protocol, "call_tool": CallToolProtocol, "chat_tools": ChatToolsProtocol,
}


def make_protocol(
    name: str, tools: Sequence[ToolSpec], prompt_file: str = "", tokenizer: Any = None, require_tools: bool = True
) -> ToolProtocol:
    """The protocol ``name`` listing ``tools`` in its prompt; with ``require_tools``, a tool its tags name must be
    among them (a user agent drives its own loop and calls whatever tools it has: it needs none of them).
    ``tokenizer``: the model's, or the path to load it from, for a protocol that renders with its chat template
    (``needs_tokenizer``: chat_tools); the others ignore it (a path is then not loaded)."""
    if name not in PROTOCOLS:
        raise ToolSetupError(f"unknown protocol {name!r}; choose one of {', '.join(PROTOCOLS)}")
    if PROTOCOLS[name].needs_tokenizer and isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    protocol = PROTOCOLS[name](tools, prompt_file or None, tokenizer)
    available = {tool.name for tool in tools}
    missing = [tool for tool in protocol.required_tools if tool not in available] if require_tools else []
    if missing:
        raise ToolSetupError(
            f"protocol '{name}' calls the tool(s) {', '.join(missing)}, which no enabled tool provides "
            f"(enabled: {', '.join(sorted(available)) or 'none'}); add it to tools.enabled or to an MCP server's "
            "allow list"
        )
    return protocol


__all__ = [
    "ANSWER_CLOSE",
    "ANSWER_OPEN",
    "PROTOCOLS",
    "CallToolProtocol",
    "ChatToolsProtocol",
    "PromptTemplate",
    "SearchR1Protocol",
    "ToolProtocol",
    "TurnAction",
    "make_protocol",
]
