"""Search-R1's tags: ``<search>query</search>`` answered with ``<information>...</information>``; ``<answer>`` ends."""

from __future__ import annotations

from collections.abc import Sequence

from ..base import Document, ErrorKind, ParsedTurn, ToolCall, TurnKind
from .base import ANSWER_CLOSE, ToolProtocol, invalid, parse_tagged_turn

SEARCH_OPEN, SEARCH_CLOSE = "<search>", "</search>"


class SearchR1Protocol(ToolProtocol):
    """Search-R1 tags: ``<search>query</search>`` calls the ``search`` tool, ``<answer>...</answer>`` ends."""

    name = "search_r1"
    stop_strings: tuple[str, ...] = (SEARCH_CLOSE, ANSWER_CLOSE)
    required_tools = ("search",)

    def parse_turn(self, text: str) -> ParsedTurn:
        return parse_tagged_turn(text, SEARCH_CLOSE, _parse_search)

    def render_documents(self, documents: Sequence[Document]) -> str:
        return "\n".join(f"Doc {rank}(Title: {doc.title}) {doc.text}" for rank, doc in enumerate(documents, start=1))

    def wrap(self, body: str) -> str:
        return f"\n\n<information>{body}</information>\n\n"


def _parse_search(before_close: str) -> ParsedTurn:
    start = before_close.rfind(SEARCH_OPEN)
    if start < 0:
        return invalid(
            f"missing {SEARCH_OPEN} opening tag; write {SEARCH_OPEN} query {SEARCH_CLOSE}", ErrorKind.UNPARSEABLE
        )
    query = before_close[start + len(SEARCH_OPEN) :].strip()
    if not query:
        return invalid("empty search query", ErrorKind.EMPTY_QUERY)
    return ParsedTurn(TurnKind.TOOL_CALL, call=ToolCall("search", query))
