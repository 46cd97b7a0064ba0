"""Chat trajectories for supervised fine-tuning, tokenised the way the agent loop builds a rollout.

A row is ``{"messages": [...], "id"?: ...}``: leading ``system``/``user`` messages form the prompt (the model's chat
template with the generation prompt, as `AgentLoop.prompt_ids` renders it), then ``assistant`` and ``tool``
messages follow one another, each tokenised on its own and appended, as a rollout appends sampled tokens and
observation tokens. Assistant tokens are trained (loss mask 1), tool tokens are not (0).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .dataset import DatasetError, _read_jsonl

PROMPT_ROLES = ("system", "user")
RESPONSE_ROLES = ("assistant", "tool")


@dataclass(frozen=True)
class ChatExample:
    id: str
    token_ids: list[int]
    response_start: int  # the prompt is token_ids[:response_start]
    loss_mask: list[int]  # per response token: 1 on assistant tokens, 0 on tool tokens


def load_chat_dataset(path: str | os.PathLike, tokenizer, max_tokens: int) -> list[ChatExample]:
    """Tokenised chat rows of a JSONL file. A malformed row, a row longer than ``max_tokens`` tokens and an empty file
    are `DatasetError`s naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"chat dataset file not found: {path}")
    if path.suffix != ".jsonl":
        raise DatasetError(f"{path}: chat datasets are .jsonl files (one {{\"messages\": [...]}} object per line)")
    examples = []
    for index, (location, row) in enumerate(_read_jsonl(path)):
        example = _tokenise(row, location, f"{path.stem}-{index}", tokenizer)
        if len(example.token_ids) > max_tokens:
            raise DatasetError(
                f"{location}: {len(example.token_ids)} tokens, more than the limit of {max_tokens} "
                "(data.max_tokens): shorten or drop the row, or raise the limit"
            )
        examples.append(example)
    if not examples:
        raise DatasetError(f"{path} contains no rows (the file is empty or has only blank lines)")
    return examples


def _tokenise(row: Any, location: str, fallback_id: str, tokenizer) -> ChatExample:
    messages, num_prompt = _check_messages(row, location)
    prompt_text = tokenizer.apply_chat_template(messages[:num_prompt], add_generation_prompt=True, tokenize=False)
    token_ids = tokenizer.encode(prompt_text, add_special_tokens=False)
    response_start = len(token_ids)
    loss_mask: list[int] = []
    for message in messages[num_prompt:]:
        ids = tokenizer.encode(message["content"], add_special_tokens=False)
        token_ids.extend(ids)
        loss_mask.extend([int(message["role"] == "assistant")] * len(ids))
    row_id = row.get("id")
    return ChatExample(fallback_id if row_id is None else str(row_id), token_ids, response_start, loss_mask)


def _check_messages(row: Any, location: str) -> tuple[list[dict[str, str]], int]:
    """The row's messages and how many of them form the prompt; DatasetError naming the row when malformed."""
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
        raise DatasetError(f"{location}: expected a JSON object with a 'messages' list")
    messages = row["messages"]
    for number, message in enumerate(messages, start=1):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise DatasetError(f"{location}: message {number} must be an object with a string 'content'")
        if message.get("role") not in PROMPT_ROLES + RESPONSE_ROLES:
            raise DatasetError(
                f"{location}: message {number} has role {message.get('role')!r}; expected one of "
                f"{', '.join(PROMPT_ROLES + RESPONSE_ROLES)}"
            )
    roles = [message["role"] for message in messages]
    num_prompt = next((i for i, role in enumerate(roles) if role not in PROMPT_ROLES), len(roles))
    if "user" not in roles[:num_prompt]:
        raise DatasetError(f"{location}: the messages must start with the prompt: a 'user' message (after an optional "
                           "'system' one)")
    response = roles[num_prompt:]
    if any(role in PROMPT_ROLES for role in response):
        raise DatasetError(f"{location}: after the first assistant or tool message only 'assistant' and 'tool' "
                           "messages may follow (one multi-turn answer, as the agent loop writes it)")
    if not response or response[-1] != "assistant" or not any(m["content"] for m in messages[num_prompt:]
                                                               if m["role"] == "assistant"):
        raise DatasetError(f"{location}: the response must end with a non-empty 'assistant' message")
    return messages, num_prompt
