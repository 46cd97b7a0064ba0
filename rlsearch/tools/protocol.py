"""The Search-R1 tool-call protocol: prompt wording, turn parsing and observation rendering."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

SEARCH_OPEN, SEARCH_CLOSE = "<search>", "</search>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    query: str


class TurnKind(str, Enum):
    TOOL_CALL = "tool_call"
    ANSWER = "answer"
    INVALID_CALL = "invalid_call"
    NONE = "none"


@dataclass(frozen=True)
class ParsedTurn:
    kind: TurnKind
    call: ToolCall | None = None
    answer: str | None = None
    error: str | None = None


class SearchR1Protocol:
    """Search-R1 tags: ``<search>query</search>`` calls the retriever, ``<answer>...</answer>`` ends."""

    name = "search_r1"
    stop_strings: tuple[str, ...] = (SEARCH_CLOSE, ANSWER_CLOSE)
    tag_strings: tuple[str, ...] = (SEARCH_OPEN, SEARCH_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)

    def instruction(self, question: str) -> str:
        return (
            "Solve the question below. Each time you receive new information, first reason about it "
            "between <think> and </think>. If your knowledge is not enough, query a search engine by "
            "writing <search> your query </search>; the top results will be returned to you between "
            "<information> and </information>. You may search as often as you need. Once you can "
            "answer, write only the final answer between <answer> and </answer>, with no explanation, "
            "for example <answer> Paris </answer>. "
            f"Question: {question}\n"
        )

    def parse_turn(self, text: str) -> ParsedTurn:
        """Classify one generated turn.

        The earliest closing tag decides the action because generation stops there; anything after it
        is spill-over from the final token.
        """
        answer_end = text.find(ANSWER_CLOSE)
        search_end = text.find(SEARCH_CLOSE)
        if answer_end >= 0 and (search_end < 0 or answer_end < search_end):
            return _parse_answer(text[:answer_end])
        if search_end >= 0:
            return _parse_search(text[:search_end])
        return ParsedTurn(TurnKind.NONE)

    def observation(self, documents: Sequence[str]) -> str:
        lines = (_render_document(rank, contents) for rank, contents in enumerate(documents, start=1))
        return "\n\n<information>" + "\n".join(lines) + "</information>\n\n"

    def error_observation(self, message: str) -> str:
        return f"\n\n<information>Error: {message}</information>\n\n"


def _parse_answer(before_close: str) -> ParsedTurn:
    start = before_close.rfind(ANSWER_OPEN)
    if start < 0:
        return ParsedTurn(TurnKind.INVALID_CALL, error=f"missing {ANSWER_OPEN} opening tag")
    return ParsedTurn(TurnKind.ANSWER, answer=before_close[start + len(ANSWER_OPEN) :].strip())


def _parse_search(before_close: str) -> ParsedTurn:
    start = before_close.rfind(SEARCH_OPEN)
    if start < 0:
        return ParsedTurn(
            TurnKind.INVALID_CALL,
            error=f"missing {SEARCH_OPEN} opening tag; write {SEARCH_OPEN} query {SEARCH_CLOSE}",
        )
    query = before_close[start + len(SEARCH_OPEN) :].strip()
    if not query:
        return ParsedTurn(TurnKind.INVALID_CALL, error="empty search query")
    return ParsedTurn(TurnKind.TOOL_CALL, call=ToolCall("search", query))


def _render_document(rank: int, contents: str) -> str:
    # Search-R1 corpus passages are '"Title"\nbody'; the first line is the title.
    title, _, body = contents.partition("\n")
    return f"Doc {rank}(Title: {title}) {body}"
