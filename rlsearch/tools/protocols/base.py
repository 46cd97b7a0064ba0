"""What a tool-call protocol is: the prompt, how a generated turn becomes an action, how tool output is rendered.

A protocol is chosen by ``rollout.protocol``:
- ``search_r1``: ``<search>query</search>`` answered with ``<information>...</information>``; ``<answer>`` ends.
- ``call_tool``: DR Tulu's unified format ``<call_tool name="NAME" attr="...">query</call_tool>`` answered with
  ``<tool_output>`` wrapping ``<snippet id=...>`` / ``<webpage id=...>`` items (see call_tool.py);
- ``chat_tools``: the model's own chat-template tool calling, Qwen style: ``<tool_call>`` JSON blocks, any number
  per turn, answered by tool messages (see chat_tools.py).
The tag protocols stop generation at their ``stop_strings``; the earliest closing tag in a turn decides the action.
Prompts come from a YAML file per protocol (rlsearch/tools/protocols/prompts/NAME.yaml, or ``rollout.prompt_file``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..base import Document, ErrorKind, ParsedTurn, ToolCall, ToolSpec, TurnKind

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


@dataclass(frozen=True)
class TurnAction:
    """What follows a generated turn: its tool calls run (in order), its error is shown (an invalid call), the
    trajectory ends with its answer, or (none) the turn did not end in an action and the trajectory ends."""

    kind: TurnKind
    calls: tuple[ToolCall, ...] = ()
    error: str | None = None
    error_kind: ErrorKind | None = None


class ToolProtocol(ABC):
    """Turn text <-> actions for one format. Subclasses set ``name``, ``stop_strings`` and the parsing."""

    name: str
    stop_strings: tuple[str, ...]
    stop_token_ids: tuple[int, ...] = ()  # token ids that also end a turn
    required_tools: tuple[str, ...] = ()  # tools the format itself names (Search-R1's <search> -> search)
    needs_tokenizer = False  # True: it renders with the model's tokenizer (make_protocol's ``tokenizer``)

    def __init__(
        self, tools: Sequence[ToolSpec] = (), prompt_file: str | Path | None = None, tokenizer: Any = None
    ) -> None:
        self.prompt = PromptTemplate.load(prompt_file or PROMPTS_DIR / f"{self.name}.yaml")
        self.tools = list(tools)
        self.tokenizer = tokenizer

    @property
    def template_kwargs(self) -> dict:
        """Extra arguments of ``apply_chat_template`` for the prompt (chat_tools: the tools' schemas)."""
        return {}

    def system_prompt(self) -> str:
        return self._fill(self.prompt.system, question="")

    def instruction(self, question: str) -> str:
        """The user turn."""
        return self._fill(self.prompt.user, question=question)

    def parse_turn(self, text: str) -> ParsedTurn:
        """Classify one turn that ended at a stop string (text up to and including it, maybe a little spill-over).
        Tag protocols implement this; a protocol that overrides ``parse_completion`` need not."""
        raise NotImplementedError(f"protocol '{self.name}' parses whole completions (parse_completion)")

    def parse_completion(self, text: str, finish_reason: str, stop_reason: str | int | None) -> TurnAction:
        """The action of a generated turn, given how the engine ended it (vLLM's finish and stop reasons): a tag
        protocol acts only on a turn that its stop string (a closing tag) ended."""
        if finish_reason != "stop" or stop_reason not in self.stop_strings:
            return TurnAction(TurnKind.NONE)
        parsed = self.parse_turn(text)
        calls = (parsed.call,) if parsed.call else ()
        return TurnAction(parsed.kind, calls, parsed.error, parsed.error_kind)

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

    def turn_observation(self, outputs: Sequence[str], last_token_id: int) -> str:
        """The text appended after a turn whose last sampled token is ``last_token_id``: ``outputs`` are what its
        calls returned (``observation`` / ``error_observation`` texts, in call order). A tag protocol's turn has one
        call, and its output is the whole observation."""
        (output,) = outputs
        return output

    def _fill(self, template: str, question: str) -> str:
        tool_list = "\n".join(self.prompt.tool_line.format(name=t.name, description=t.description) for t in self.tools)
        return template.format(question=question, tools=tool_list)


def parse_tagged_turn(text: str, call_close: str, parse_call: Callable[[str], ParsedTurn]) -> ParsedTurn:
    """A turn of a tag protocol: the earliest closing tag decides the action (generation stops there) and anything
    after it is spill-over. ``</answer>`` first: the answer (`parse_answer`); ``call_close`` first: ``parse_call`` of
    the text before it; neither: no action."""
    answer_end = text.find(ANSWER_CLOSE)
    call_end = text.find(call_close)
    if answer_end >= 0 and (call_end < 0 or answer_end < call_end):
        return parse_answer(text[:answer_end])
    if call_end >= 0:
        return parse_call(text[:call_end])
    return ParsedTurn(TurnKind.NONE)


def parse_answer(before_close: str) -> ParsedTurn:
    """The answer block closed at the end of ``before_close``: the text after its last ``<answer>``."""
    start = before_close.rfind(ANSWER_OPEN)
    if start < 0:
        return invalid(f"missing {ANSWER_OPEN} opening tag", ErrorKind.UNPARSEABLE)
    return ParsedTurn(TurnKind.ANSWER, answer=before_close[start + len(ANSWER_OPEN) :].strip())


def invalid(message: str, kind: ErrorKind) -> ParsedTurn:
    return ParsedTurn(TurnKind.INVALID_CALL, error=message, error_kind=kind)
