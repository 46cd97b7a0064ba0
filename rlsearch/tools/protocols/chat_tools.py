"""Native tool calling in the model's own chat template (``rollout.protocol=chat_tools``), Qwen2.5/Qwen3 style.

- The prompt is rendered by ``apply_chat_template(messages, tools=...)``: the template lists the tools (their JSON
  schemas, ``openai_tool_schemas``) and the call format in the system turn.
- The model writes any number of ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks and ends
  its turn with the end-of-turn token (``<|im_end|>``). Generation stops at that token (``stop_token_ids``), not
  at ``</tool_call>``: a turn can hold several calls, and stopping at the first closing tag would cut it short.
  A turn the model ended without a call is its final answer (the reward reads the ``<answer>`` block in it).
- A turn's calls run together (``ToolRegistry.run``) and their outputs come back in call order, each as a tool
  message; Qwen's template renders consecutive ones as one user turn of ``<tool_response>`` blocks.

Token ids stay the truth: the observation appended after the sampled ids is the template's own text after the
assistant turn, found by rendering a conversation (not hard-coded), tokenised alone, loss mask 0. It includes
- the seam, what the template writes after the end-of-turn token (Qwen: the newline before ``<|im_start|>user``),
  which a loop that starts the observation at ``<|im_start|>`` drops (verl issue #6501);
- the end-of-turn token itself when the turn was cut before it (``max_tokens_per_turn``) but holds complete calls:
  the calls still run, and the observation closes the turn as the template would.

``template_mismatches`` compares a trajectory's ids with the template's rendering of its whole conversation and
names each difference that is one of the ``KNOWN_SEAMS``.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..base import Document, ErrorKind, ToolCall, ToolSetupError, ToolSpec, TurnKind
from .base import ToolProtocol, TurnAction

if TYPE_CHECKING:
    from ...trajectory import Trajectory

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# stand-ins in the conversations rendered to learn what the template writes around a turn
_MARK = "\x00rlsearch-turn\x00"
_PROBE_QUESTION = "?"
_PROBE_TOOL = "rlsearch_probe_tool"
_PROBE_OUTPUT = "rlsearch probe output"

KNOWN_SEAMS = {
    "sampled": "the policy's ids are kept as sampled; the template's text of its turn (the engine's text, special "
    "tokens left out) can tokenise differently",
    "turn_start": "the text before a turn (the assistant header, a prefilled rollout.assistant_prefix) is tokenised "
    "without the turn, whose first characters re-encoding can merge with it",
    "end": "the template closes the last assistant turn (end-of-turn token, newline) where generation stopped",
}
_PROMPT, _SAMPLED, _INSERTED = "prompt", "sampled", "inserted"


def parse_tool_calls(text: str) -> tuple[list[ToolCall], str | None]:
    """The ``<tool_call>`` blocks of ``text`` as calls, in order, and the first problem, or None.

    A block's body must be a JSON object with a non-empty string ``"name"`` and an object ``"arguments"`` (a JSON
    string holding an object is accepted; absent means ``{}``). A call's ``query`` is empty and its ``arguments``
    are the typed JSON (the tool registry derives the query the built-in tools read). At a bad block, or an
    opening tag never closed, parsing stops: the calls before it come back with the error. Text around the blocks
    (reasoning) is not part of any call.
    """
    calls: list[ToolCall] = []
    position = 0
    while (start := text.find(CALL_OPEN, position)) >= 0:
        body_start = start + len(CALL_OPEN)
        end = text.find(CALL_CLOSE, body_start)
        if end < 0:
            return calls, f"tool call {len(calls) + 1}: {CALL_OPEN} is never closed with {CALL_CLOSE}"
        call, error = _parse_call(text[body_start:end])
        if call is None:
            return calls, f"tool call {len(calls) + 1}: {error}"
        calls.append(call)
        position = end + len(CALL_CLOSE)
    return calls, None


def _parse_call(body: str) -> tuple[ToolCall | None, str]:
    try:
        value = json.loads(body)
    except ValueError as error:
        return None, f"invalid JSON ({error})"
    except RecursionError:
        return None, "invalid JSON (nested too deeply)"
    if not isinstance(value, dict):
        return None, 'expected a JSON object {"name": ..., "arguments": {...}}'
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        return None, 'missing "name" (the tool to call)'
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # reported below as not an object
    if not isinstance(arguments, dict):
        return None, f'the "arguments" of {name.strip()!r} must be a JSON object'
    return ToolCall(name.strip(), "", arguments=arguments), ""


def openai_tool_schemas(specs: Sequence[ToolSpec]) -> list[dict]:
    """The tools as OpenAI-style function schemas, the form chat templates take in ``tools=``."""
    return [
        {"type": "function",
         "function": {"name": spec.name, "description": spec.description, "parameters": spec.parameters}}
        for spec in specs
    ]


class ChatToolsProtocol(ToolProtocol):
    """The model's chat-template tool calls; needs the model's tokenizer (its template must render Qwen-style
    tools: schemas in the system turn, ``<tool_call>`` JSON blocks). Tool output budgets
    (``rollout.max_observation_tokens``) apply to each call's output."""

    name = "chat_tools"
    stop_strings: tuple[str, ...] = ()
    needs_tokenizer = True

    def __init__(
        self, tools: Sequence[ToolSpec] = (), prompt_file: str | Path | None = None, tokenizer: Any = None
    ) -> None:
        super().__init__(tools, prompt_file, tokenizer)
        if tokenizer is None:
            raise ToolSetupError("protocol 'chat_tools' renders with the model's chat template: it needs its tokenizer")
        self._check_template()
        self.end_of_turn, self.end_of_turn_id = template_end_of_turn(tokenizer)
        self.stop_token_ids = (self.end_of_turn_id,)

    @property
    def template_kwargs(self) -> dict:
        return {"tools": openai_tool_schemas(self.tools)}

    def parse_completion(self, text: str, finish_reason: str, stop_reason: str | int | None) -> TurnAction:
        """The calls run, also in a turn cut at the token limit (its closed blocks are complete); a bad or unclosed
        block makes the turn an invalid call (none of its calls run); a turn the model ended without a call is the
        answer; a turn cut without one is no action."""
        calls, error = parse_tool_calls(text)
        if error:
            return TurnAction(TurnKind.INVALID_CALL, error=error, error_kind=ErrorKind.UNPARSEABLE)
        if calls:
            return TurnAction(TurnKind.TOOL_CALL, tuple(calls))
        return TurnAction(TurnKind.ANSWER if finish_reason == "stop" else TurnKind.NONE)

    def render_documents(self, documents: Sequence[Document]) -> str:
        if not documents:
            return "No results."
        return "\n\n".join(_render_document(rank, document) for rank, document in enumerate(documents, start=1))

    def wrap(self, body: str) -> str:
        return body  # a tool message's content: the template frames it

    def turn_observation(self, outputs: Sequence[str], last_token_id: int) -> str:
        """The template's text after the assistant turn: the seam after its end-of-turn token, ``outputs`` as tool
        messages and the next assistant header; led by the end-of-turn token when the turn was cut before it."""
        closing = "" if last_token_id == self.end_of_turn_id else self.end_of_turn
        placeholder_calls = [_function_call(f"tool_{index}", {}) for index in range(len(outputs))]
        text = self._render(
            [{"role": "user", "content": _PROBE_QUESTION},
             {"role": "assistant", "content": _MARK, "tool_calls": placeholder_calls},
             *({"role": "tool", "content": output} for output in outputs)],
            add_generation_prompt=True,
        )
        turn_end = text.index(self.end_of_turn, text.index(_MARK) + len(_MARK)) + len(self.end_of_turn)
        return closing + text[turn_end:]

    def final_turn_close(self) -> str:
        """What the template writes after the content of the conversation's last assistant turn."""
        text = self._render([{"role": "user", "content": _PROBE_QUESTION}, {"role": "assistant", "content": _MARK}])
        return text[text.index(_MARK) + len(_MARK) :]

    def _render(self, messages: list[dict], add_generation_prompt: bool = False, **kwargs: Any) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def _check_template(self) -> None:
        probe_schema = openai_tool_schemas([ToolSpec(_PROBE_TOOL, "a probe")])
        conversation = [
            {"role": "user", "content": _PROBE_QUESTION},
            {"role": "assistant", "content": "", "tool_calls": [_function_call(_PROBE_TOOL, {"probe": 1})]},
            {"role": "tool", "content": _PROBE_OUTPUT},
        ]
        try:
            text = self._render(conversation, add_generation_prompt=True, tools=probe_schema)
        except Exception as error:  # jinja2's TemplateError, or the template's own raise_exception
            raise ToolSetupError(f"protocol 'chat_tools': the chat template fails on tool calls: {error}") from error
        qwen_call = f'{CALL_OPEN}\n{{"name": "{_PROBE_TOOL}"'
        if text.count(_PROBE_TOOL) < 2 or qwen_call not in text or _PROBE_OUTPUT not in text:
            raise ToolSetupError(
                "protocol 'chat_tools' needs a chat template with Qwen-style tool calling (the tools listed from "
                f"tools=..., calls written as {CALL_OPEN}{{\"name\": ..., \"arguments\": ...}}{CALL_CLOSE}); this "
                "model's template does not render them: use a Qwen2.5/Qwen3 model or another rollout.protocol"
            )


def template_end_of_turn(tokenizer: Any) -> tuple[str, int]:
    """The special token that ends an assistant turn in the tokenizer's chat template, and its id."""
    text = tokenizer.apply_chat_template([
        {"role": "user", "content": _PROBE_QUESTION}, {"role": "assistant", "content": _MARK},
        {"role": "user", "content": _PROBE_QUESTION},
    ], tokenize=False)
    after = text[text.index(_MARK) + len(_MARK) :]
    first = tokenizer.encode(after, add_special_tokens=False)[:1]
    token = tokenizer.decode(first) if first else ""
    if not first or first[0] not in tokenizer.get_added_vocab().values() or not after.startswith(token):
        raise ToolSetupError(
            "the chat template does not end an assistant turn with a special token "
            f"(after the content it writes {after[:40]!r}); generation could not stop at the turn's end"
        )
    return token, first[0]


def _function_call(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _render_document(rank: int, document: Document) -> str:
    lines = [f"[{rank}] {document.title}".rstrip()]
    if document.url:
        lines.append(f"URL: {document.url}")
    lines.append(document.text)
    return "\n".join(lines)


@dataclass(frozen=True)
class TemplateMismatch:
    """Where a trajectory's ids and the template's rendering of its conversation differ."""

    position: int  # index into the trajectory's ids (prompt + response)
    rendered_position: int  # index into the ids of the rendering
    text: str  # the trajectory's ids there, decoded
    rendered_text: str
    ids: tuple[int, ...]
    rendered_ids: tuple[int, ...]
    seam: str | None  # the KNOWN_SEAMS entry that explains it; None: the observation ids are wrong


def conversation_messages(prompt_messages: Sequence[dict], trajectory: Trajectory) -> list[dict]:
    """The trajectory as chat messages: the prompt's, then each turn as an assistant message with the text the model
    wrote (its tool calls as written, a prefilled assistant_prefix in the first) and the tool messages of each
    observation appended (every turn's but the last)."""
    messages = list(prompt_messages)
    for index, turn in enumerate(trajectory.turns):
        prefix = trajectory.assistant_prefix if index == 0 else ""
        messages.append({"role": "assistant", "content": prefix + turn.text})
        if index < len(trajectory.turns) - 1:
            messages.extend({"role": "tool", "content": output} for output in turn.tool_outputs)
    return messages


def template_mismatches(
    protocol: ChatToolsProtocol, prompt_messages: Sequence[dict], trajectory: Trajectory
) -> list[TemplateMismatch]:
    """The differences between the trajectory's ids and ``apply_chat_template`` of its whole conversation,
    tokenised; each is named by its known seam, or has ``seam`` None (a real difference: a dropped or extra token
    where the loop inserted text). ``prompt_messages``: what the trajectory's prompt was rendered from."""
    tokenizer = protocol.tokenizer
    text = tokenizer.apply_chat_template(
        conversation_messages(prompt_messages, trajectory), tokenize=False, **protocol.template_kwargs
    )
    rendered = tokenizer.encode(text, add_special_tokens=False)
    ids = trajectory.prompt_ids + trajectory.response_ids
    origins = [_PROMPT] * len(trajectory.prompt_ids) + [_SAMPLED if m else _INSERTED for m in trajectory.loss_mask]
    blocks = [op[1:] for op in difflib.SequenceMatcher(None, ids, rendered, autojunk=False).get_opcodes()
              if op[0] != "equal"]

    def texts(block: tuple[int, ...]) -> tuple[str, str]:
        i1, i2, j1, j2 = block
        return tokenizer.decode(ids[i1:i2]), tokenizer.decode(rendered[j1:j2])

    mismatches = []
    for i1, i2, j1, j2 in _merge_within_sampled(blocks, origins, texts):
        ours, theirs = texts((i1, i2, j1, j2))
        at_end = i2 == len(ids) and j2 == len(rendered)
        seam = _seam([origins[k] for k in _context(i1, i2, len(ids))], ours, theirs, at_end, protocol)
        mismatches.append(TemplateMismatch(i1, j1, ours, theirs, tuple(ids[i1:i2]), tuple(rendered[j1:j2]), seam))
    return mismatches


def _context(i1: int, i2: int, length: int) -> range:
    """The trajectory's tokens a difference concerns: its own, or for an insertion the two around it."""
    return range(i1, i2) if i2 > i1 else range(max(i1 - 1, 0), min(i1 + 1, length))


def _merge_within_sampled(
    blocks: list[tuple[int, ...]], origins: list[str], texts: Callable[[tuple[int, ...]], tuple[str, str]]
) -> list[tuple[int, ...]]:
    """A difference whose two sides do not decode to the same text, merged with the next one in the same run of
    sampled tokens: a re-tokenisation can match single tokens in between, splitting one difference in parts."""
    merged: list[tuple[int, ...]] = []
    for block in blocks:
        if merged:
            previous = merged[-1]
            span = range(_context(*previous[:2], len(origins)).start, _context(*block[:2], len(origins)).stop)
            ours, theirs = texts(previous)
            if ours != theirs and all(origins[k] == _SAMPLED for k in span):
                merged[-1] = (previous[0], block[1], previous[2], block[3])
                continue
        merged.append(block)
    return merged


def _seam(origins: list[str], ours: str, theirs: str, at_end: bool, protocol: ChatToolsProtocol) -> str | None:
    if at_end and set(origins) <= {_SAMPLED} and theirs.startswith(ours) and theirs != ours \
            and protocol.final_turn_close().endswith(theirs[len(ours) :]):
        return "end"
    if origins and set(origins) == {_SAMPLED}:
        return "sampled"
    first_sampled = origins.index(_SAMPLED) if _SAMPLED in origins else -1
    if ours == theirs and first_sampled > 0 and set(origins[first_sampled:]) == {_SAMPLED}:
        return "turn_start"
    return None
