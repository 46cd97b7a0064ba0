"""OpenAI-style chat messages to prompt text with the model's chat template (as vLLM's chat endpoint does)."""

from __future__ import annotations

import json

_CONTINUE_MARK = "\x00rlsearch-continue\x00"


class RequestError(ValueError):
    """A request the endpoint answers with 400 (the message says what to change)."""


class ChatRenderer:
    """Renders messages with the tokenizer's chat template. Messages are normalised first: content parts joined
    into text, tool-call arguments given as JSON strings (the OpenAI wire form) parsed into objects."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def render(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
        continue_final_message: bool = False, template_kwargs: dict | None = None,
    ) -> str:
        """The prompt text. ``continue_final_message``: the last (assistant) message stays open and generation
        continues its content (the turn is not closed, no new turn is started)."""
        messages = [normalise_message(message) for message in messages]
        if not messages:
            raise RequestError("'messages' is empty")
        kwargs = dict(template_kwargs or {})
        if tools:
            kwargs["tools"] = tools
        if not continue_final_message:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        final = messages[-1]
        if final["role"] != "assistant":
            raise RequestError("continue_final_message needs the last message to be the assistant's")
        marked = [*messages[:-1], {**final, "content": _CONTINUE_MARK}]
        text = self.tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=False, **kwargs)
        cut = text.rfind(_CONTINUE_MARK)
        if cut < 0:
            raise RequestError("the chat template does not render the final assistant message's content")
        return text[:cut] + final["content"]


def normalise_message(message: dict) -> dict:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(f"every message needs a 'role'; got {message!r:.200}")
    normal = {key: value for key, value in message.items() if value is not None}
    normal["content"] = _text(message.get("content"))
    if message.get("tool_calls"):
        normal["tool_calls"] = [_tool_call(call) for call in message["tool_calls"]]
    return normal


def _text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = [part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        if len(parts) != len(content):
            raise RequestError("only text content parts are supported")
        return "".join(parts)
    raise RequestError(f"message content must be a string or a list of text parts; got {type(content).__name__}")


def _tool_call(call: dict) -> dict:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments) if arguments.strip() else {}
        except ValueError as error:
            raise RequestError(f"tool call arguments are not JSON: {error}") from None
    return {**call, "function": function}
