"""The tokens of one agent session, built token-exactly from its model calls.

Every call's prompt is matched against what the session already holds:
- **text extension**: the rendered prompt starts with the text of the current segment (its prompt text, then the
  text of the tokens the engine sampled): the prompt is the segment's ids plus the tokenisation of the new suffix
  alone. Model output is never re-tokenised.
- **message extension** (chat calls): the messages start with the previous call's messages plus the assistant
  message the endpoint returned (the template may render that message differently from what was sampled, e.g. tool
  calls as re-serialised JSON): the prompt is the segment's ids, then the template's text after the assistant
  turn (the seam: the newline Qwen's template puts after ``<|im_end|>``; ``<|im_end|>`` itself when the turn was
  cut before the model ended it), then the rendering of the new messages.
- **id extension** (a completion request with token ids): the ids start with the segment's ids.
Anything else (the agent dropped or edited earlier turns) starts a new segment from the rendered prompt.

Inserted tokens (tool output, user turns, seams) have loss mask 0; sampled tokens mask 1 with the engine logprob.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from ...trajectory import Segment

Render = Callable[[list[dict], bool], str]  # (messages, add_generation_prompt) -> text


@dataclass
class SegmentState:
    ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    prompt_len: int  # tokens of the segment's first prompt; everything after it is the response
    text: str  # the text these ids stand for (sampled ids decoded with their special tokens)
    messages: list[dict] | None = None  # chat: the last call's messages plus the assistant message returned
    ended_turn: bool = False  # the last sampled token closed the assistant turn (end-of-turn token)

    def to_segment(self) -> Segment:
        cut = self.prompt_len
        return Segment(self.ids[:cut], self.ids[cut:], self.loss_mask[cut:], self.logprobs[cut:])


@dataclass
class PlannedPrompt:
    """The ids of a call's prompt and how they relate to the session's current segment."""

    ids: list[int]
    extends: bool  # False: the call starts a new segment
    inserted: list[int] = field(default_factory=list)  # ids appended to the segment before sampling (mask 0)


class SessionTokens:
    """The segments of one session. ``plan`` decides a call's prompt ids; ``record`` adds what the engine sampled."""

    def __init__(self, tokenizer, end_of_turn: str) -> None:
        self.tokenizer = tokenizer
        self.end_of_turn = end_of_turn
        self.end_of_turn_id = tokenizer.convert_tokens_to_ids(end_of_turn)
        self.segments: list[SegmentState] = []

    @property
    def current(self) -> SegmentState | None:
        return self.segments[-1] if self.segments else None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def plan_text(self, text: str, messages: list[dict] | None = None, render: Render | None = None) -> PlannedPrompt:
        """The prompt of a call rendered to ``text`` (chat calls also give their messages and the renderer)."""
        segment = self.current
        if segment is not None and text.startswith(segment.text):
            inserted = self.encode(text[len(segment.text):])
            return PlannedPrompt(segment.ids + inserted, True, inserted)
        if segment is not None and messages is not None and render is not None:
            if (inserted := self._message_extension(segment, messages, render)) is not None:
                return PlannedPrompt(segment.ids + inserted, True, inserted)
        return PlannedPrompt(self.encode(text), False)

    def plan_ids(self, ids: list[int]) -> PlannedPrompt:
        segment = self.current
        if segment is not None and ids[: len(segment.ids)] == segment.ids:
            inserted = list(ids[len(segment.ids):])
            return PlannedPrompt(list(ids), True, inserted)
        return PlannedPrompt(list(ids), False)

    def tokens_after_first_prompt(self, prompt: PlannedPrompt) -> int:
        """How many tokens past the length of the session's first prompt the call's prompt holds: what the call has
        already used of the trajectory's budget (rollout.max_response_tokens). A new segment (an agent that strips or
        re-renders its history) counts the tokens it sends again, so every call is held to one budget."""
        if not self.segments:
            return 0
        return max(0, len(prompt.ids) - self.segments[0].prompt_len)

    def record(
        self, prompt: PlannedPrompt, prompt_text: str, sampled: list[int], logprobs: list[float],
        messages: list[dict] | None = None,
    ) -> None:
        """Add a finished call: ``prompt_text`` is the text of the prompt as sent (rendered or given);
        ``messages`` (chat) are its messages plus the assistant message returned."""
        if prompt.extends:
            segment = self.current
            segment.ids.extend(prompt.inserted)
            segment.loss_mask.extend([0] * len(prompt.inserted))
            segment.logprobs.extend([0.0] * len(prompt.inserted))
        else:
            segment = SegmentState(list(prompt.ids), [0] * len(prompt.ids), [0.0] * len(prompt.ids),
                                   prompt_len=len(prompt.ids), text="")
            self.segments.append(segment)
        segment.ids.extend(sampled)
        segment.loss_mask.extend([1] * len(sampled))
        segment.logprobs.extend(logprobs)
        segment.text = prompt_text + self.tokenizer.decode(sampled, skip_special_tokens=False)
        segment.messages = messages
        segment.ended_turn = bool(sampled) and sampled[-1] == self.end_of_turn_id

    def _message_extension(self, segment: SegmentState, messages: list[dict], render: Render) -> list[int] | None:
        """The ids to insert when ``messages`` extend the segment's last call and its returned message; None if not."""
        previous = segment.messages
        if previous is None or len(messages) <= len(previous):
            return None
        if not _same_messages(messages[: len(previous)], previous):
            return None
        before = render(previous, False)  # ... the assistant turn, as the template closes it
        after = render(messages, True)
        if not after.startswith(before):
            return None  # the template rewrites earlier turns when new ones follow (e.g. it drops their thinking)
        closing = before.rfind(self.end_of_turn)
        if closing < 0:
            return None
        seam = before[closing + len(self.end_of_turn):]
        if not segment.ended_turn:
            seam = self.end_of_turn + seam
        return self.encode(seam + after[len(before):])


def _same_messages(left: list[dict], right: list[dict]) -> bool:
    return [_message_key(message) for message in left] == [_message_key(message) for message in right]


def _message_key(message: dict) -> tuple:
    """What identifies a message for the extension check (the client may add fields set to null or reorder keys)."""
    calls = tuple(
        (call.get("function", {}).get("name"), _arguments_key(call.get("function", {}).get("arguments")))
        for call in message.get("tool_calls") or ()
    )
    return message.get("role"), message.get("content") or "", calls


def _arguments_key(arguments) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True)
