"""DR Tulu's unified tool-call format: ``<call_tool name="NAME" attr="...">query</call_tool>``.

The tool answers with ``<tool_output>`` wrapping ``<snippet id=...>`` items (search hits) or ``<webpage id=...>``
items (fetched pages); ``<answer>...</answer>`` ends the trajectory. Parsing rules:
- the earliest closing tag (``</call_tool>`` or ``</answer>``) decides; text after it is spill-over;
- the call is the last ``<call_tool`` opening tag before that closing tag (an earlier unclosed or enclosing
  opening tag is part of the model's reasoning);
- attributes are ``key="value"``, ``key='value'`` (either quote may appear inside the other) or ``key=bare``;
- a missing ``name``, a repeated attribute, or an opening tag that never ends in ``>`` is unparseable;
- a body that is a JSON object (``{"time": "12:00", "target_timezone": "Asia/Tokyo"}``, after stripping) is the
  call's typed ``arguments``; the tag's other attributes stay in ``attrs`` and are added to the arguments as strings
  where the JSON has no such key (the JSON wins). ``query`` is the raw body either way. A body that starts with
  ``{`` but is not a JSON object (a search query with braces) is a plain query.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from ..base import Document, ErrorKind, ParsedTurn, ToolCall, TurnKind
from .base import ANSWER_CLOSE, ToolProtocol, invalid, parse_tagged_turn

CALL_OPEN, CALL_CLOSE = "<call_tool", "</call_tool>"
OUTPUT_OPEN, OUTPUT_CLOSE = "<tool_output>", "</tool_output>"
_ATTRIBUTE = re.compile(r"""\s*([A-Za-z_][\w.:-]*)\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'<>=]+))""")
_TAG_END = re.compile(r"\s*>")


class CallToolProtocol(ToolProtocol):
    name = "call_tool"
    stop_strings: tuple[str, ...] = (CALL_CLOSE, ANSWER_CLOSE)

    def parse_turn(self, text: str) -> ParsedTurn:
        return parse_tagged_turn(text, CALL_CLOSE, _parse_call)

    def render_documents(self, documents: Sequence[Document]) -> str:
        if not documents:
            return "No results."
        return "\n".join(_render_item(document) for document in documents)

    def wrap(self, body: str) -> str:
        return f"\n{OUTPUT_OPEN}\n{body}\n{OUTPUT_CLOSE}\n"


def _parse_call(before_close: str) -> ParsedTurn:
    start = _last_opening_tag(before_close)
    if start < 0:
        return invalid(f'missing opening tag; write {CALL_OPEN} name="TOOL">query{CALL_CLOSE}', ErrorKind.UNPARSEABLE)
    position = start + len(CALL_OPEN)
    attrs: dict[str, str] = {}
    while True:
        tag_end = _TAG_END.match(before_close, position)
        if tag_end:
            position = tag_end.end()
            break
        attribute = _ATTRIBUTE.match(before_close, position)
        if attribute is None:
            return invalid(
                f"malformed {CALL_OPEN} tag: expected key=\"value\" attributes and a closing '>'", ErrorKind.UNPARSEABLE
            )
        key = attribute.group(1)
        if key in attrs:
            return invalid(f"attribute '{key}' is given twice in the {CALL_OPEN} tag", ErrorKind.UNPARSEABLE)
        attrs[key] = next(value for value in attribute.group(2, 3, 4) if value is not None)
        position = attribute.end()
    name = attrs.pop("name", "").strip()
    if not name:
        return invalid(f'the {CALL_OPEN} tag has no name="TOOL" attribute', ErrorKind.UNPARSEABLE)
    query = before_close[position:].strip()
    if not query:
        return invalid(f"empty query for tool '{name}'", ErrorKind.EMPTY_QUERY)
    arguments = _json_object(query)
    if arguments is not None:
        arguments = {**attrs, **arguments}
    return ParsedTurn(TurnKind.TOOL_CALL, call=ToolCall(name, query, attrs, arguments))


def _json_object(body: str) -> dict | None:
    """The body as typed arguments when it is a JSON object, else None (it is a plain query)."""
    if not body.startswith("{"):
        return None
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nesting too deep for the decoder
        return None
    return value if isinstance(value, dict) else None


def _last_opening_tag(text: str) -> int:
    """Index of the last ``<call_tool`` that starts a tag (followed by whitespace or '>'), or -1."""
    start = text.rfind(CALL_OPEN)
    while start >= 0:
        following = text[start + len(CALL_OPEN) : start + len(CALL_OPEN) + 1]
        if following == "" or following == ">" or following.isspace():
            return start
        start = text.rfind(CALL_OPEN, 0, start)
    return -1


def _render_item(document: Document) -> str:
    tag = "webpage" if document.kind == "webpage" else "snippet"
    lines = [f"Title: {document.title}"] if document.title else []
    if document.url:
        lines.append(f"URL: {document.url}")
    lines.append(document.text)
    return f"<{tag} id={document.display_id}>\n" + "\n".join(lines) + f"\n</{tag}>"
