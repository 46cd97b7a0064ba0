"""Tool-call protocols, chosen by ``rollout.protocol``: the prompt, how a generated turn becomes an action, how tool
output is rendered. Text in, text out: nothing here talks to a tool."""

from __future__ import annotations

from collections.abc import Sequence

from ..base import ToolSetupError, ToolSpec
from .base import ANSWER_CLOSE, ANSWER_OPEN, PromptTemplate, ToolProtocol
from .call_tool import CallToolProtocol
from .search_r1 import SearchR1Protocol

PROTOCOLS: dict[str, type[ToolProtocol]] = {"search_r1": SearchR1Protocol, "call_tool": CallToolProtocol}


def make_protocol(name: str, tools: Sequence[ToolSpec], prompt_file: str = "") -> ToolProtocol:
    """The protocol ``name`` listing ``tools`` in its prompt; a tool its tags name must be among them."""
    if name not in PROTOCOLS:
        raise ToolSetupError(f"unknown protocol {name!r}; choose one of {', '.join(PROTOCOLS)}")
    protocol = PROTOCOLS[name](tools, prompt_file or None)
    available = {tool.name for tool in tools}
    missing = [tool for tool in protocol.required_tools if tool not in available]
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
    "PromptTemplate",
    "SearchR1Protocol",
    "ToolProtocol",
    "make_protocol",
]
