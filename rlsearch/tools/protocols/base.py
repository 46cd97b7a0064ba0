"""What a tool-call protocol is: the prompt, how a generated turn becomes an action, how tool output is rendered.

A protocol is chosen by ``rollout.protocol``:
- ``search_r1``: ``<search>query</search>`` answered with ``<information>...</information>``; ``<answer>`` ends.
- ``call_tool``: DR Tulu's unified format ``<call_tool name="NAME" attr="...">query</call_tool>`` answered with
  ``<tool_output>`` wrapping ``<snippet id=...>`` / ``<webpage id=...>`` items (see call_tool.py).
Generation stops at the protocol's ``stop_strings``; the earliest closing tag in a turn decides the action.
Prompts come from a YAML file per protocol (rlsearch/tools/protocols/prompts/NAME.yaml, or ``rollout.prompt_file``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..base import Document, ErrorKind, ParsedTurn, ToolSpec, TurnKind

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"


@dataclass(frozen=True)
class PromptTemplate:
    system: str  # may be empty: no system message
    user: str
    tool_line: str

    @classmethod
    def load(cls, path: str | Path) -> PromptTemplate:
        path = Path(path)
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as error:
            raise ValueError(f"prompt file {path}: {error}") from error
        missing = [key for key in ("system", "user", "tool_line") if not isinstance((raw or {}).get(key), str)]
        if missing:
            raise ValueError(f"prompt file {path}: missing string key(s) {', '.join(missing)}")
        return cls(raw["system"], raw["user"], raw["tool_line"])


class ToolProtocol(ABC):
    """Turn text <-> actions for one tag format. Subclasses set ``name``, ``stop_strings`` and the parsing."""

    name: str
    stop_strings: tuple[str, ...]
    required_tools: tuple[str, ...] = ()  # tools the format itself names (Search-R1's <search> -> search)

    def __init__(self, tools: Sequence[ToolSpec] = (), prompt_file: str | Path | None = None) -> None:
        self.prompt = PromptTemplate.load(prompt_file or PROMPTS_DIR / f"{self.name}.yaml")
        self.tools = list(tools)

    def system_prompt(self) -> str:
        return self._fill(self.prompt.system, question="")

    def instruction(self, question: str) -> str:
        """The user turn."""
        return self._fill(self.prompt.user, question=question)

    @abstractmethod
    def parse_turn(self, text: str) -> ParsedTurn:
        """Classify one generated turn (text up to and including the stop string, maybe a little spill-over)."""

    def observation(self, documents: Sequence[Document]) -> str:
        return self.wrap(self.render_documents(documents))

    def error_observation(self, message: str) -> str:
        return self.wrap(f"Error: {message}")

    @abstractmethod
    def render_documents(self, documents: Sequence[Document]) -> str:
        """The body of an observation for these documents (without the wrapping tags)."""

    @abstractmethod
    def wrap(self, body: str) -> str:
        """An observation: the body inside this protocol's output tags."""

    def _fill(self, template: str, question: str) -> str:
        tool_list = "\n".join(self.prompt.tool_line.format(name=t.name, description=t.description) for t in self.tools)
        return template.format(question=question, tools=tool_list)


def parse_answer(before_close: str) -> ParsedTurn:
    """The answer block closed at the end of ``before_close``: the text after its last ``<answer>``."""
    start = before_close.rfind(ANSWER_OPEN)
    if start < 0:
        return invalid(f"missing {ANSWER_OPEN} opening tag", ErrorKind.UNPARSEABLE)
    return ParsedTurn(TurnKind.ANSWER, answer=before_close[start + len(ANSWER_OPEN) :].strip())


def invalid(message: str, kind: ErrorKind) -> ParsedTurn:
    return ParsedTurn(TurnKind.INVALID_CALL, error=message, error_kind=kind)
