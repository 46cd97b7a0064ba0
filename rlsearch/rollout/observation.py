"""Tool output -> observation text within a token budget, cutting document text but never the closing tags."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

from ..tools import Document, ToolProtocol

TRUNCATION_MARK = " ..."
_MAX_ATTEMPTS = 4
# With no token budget (rollout.max_observation_tokens=0) the documents' text is still cut at this many characters in
# all: ordinary text that long is ~250k tokens, more than any trajectory holds (the agent loop would end it for
# length), and tokenising a runaway tool output of many MB would stall the agent loop for seconds.
UNCAPPED_MAX_CHARS = 1_000_000
# characters one token can stand for at most when the tokenizer cannot list its vocabulary
_FALLBACK_TOKEN_CHARS = 256
_token_chars: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class FittedObservation(NamedTuple):
    text: str
    cut: bool  # something of the documents was left out: rollout/truncated/tool_output


def fitted_observation(
    protocol: ToolProtocol, documents: Sequence[Document], budget: int, tokenizer
) -> FittedObservation:
    """The protocol's observation of ``documents`` in at most ``budget`` tokens (0: no budget), and whether anything
    of them had to be cut for it.

    Trailing documents whose tags alone do not fit are dropped; the texts of the rest are cut in order (the first
    documents keep the most) and re-rendered, so every item and the observation keep their closing tags. Token
    counts of parts and of the joined text can differ by a token or two at the seams, so the cut is re-checked and
    tightened.

    Output far beyond the budget (a tool returning megabytes) is first cut by characters, before any tokenising:
    to ``budget`` times the longest vocabulary entry in characters, which still holds at least ``budget`` tokens, so
    the token cut below still decides what is kept; with no budget, to ``UNCAPPED_MAX_CHARS`` characters.
    """

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    given = documents
    documents = _cut_by_characters(
        documents, budget * _max_token_chars(tokenizer) if budget > 0 else UNCAPPED_MAX_CHARS
    )
    text = protocol.observation(documents)
    if budget <= 0 or count(text) <= budget:
        return FittedObservation(text, documents is not given)
    text_ids = [tokenizer.encode(document.text, add_special_tokens=False) for document in documents]

    def allowance_for(num_items: int) -> int:
        """Tokens left for document text once the tags of ``num_items`` items are paid for."""
        return budget - count(protocol.observation([replace(d, text="") for d in documents[:num_items]]))

    # as many items as have room for their tags and some text: a cut list beats "no results"
    num_items = len(documents)
    while num_items > 1 and allowance_for(num_items) <= 0:
        num_items -= 1
    best, allowance = protocol.observation([]), allowance_for(num_items)
    for _ in range(_MAX_ATTEMPTS):
        kept = _cut(documents[:num_items], text_ids, allowance, tokenizer)
        text = protocol.observation(kept)
        size = count(text)
        if size > budget:
            allowance -= size - budget
            continue
        best = max(best, text, key=len)
        if len(kept) == num_items:
            return FittedObservation(text, True)
        # items were dropped: their tags no longer cost anything, so the kept ones get that room
        num_items = len(kept)
        allowance = allowance_for(num_items)
    return FittedObservation(best, True)


def _max_token_chars(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` stands for (its longest vocabulary entry; byte-level and
    sentencepiece entries are at least as long as the text they decode to), computed once per tokenizer."""
    try:
        return _token_chars[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        longest = max(len(token) for token in tokenizer.get_vocab())
    except (AttributeError, TypeError, ValueError):
        longest = _FALLBACK_TOKEN_CHARS
    try:
        _token_chars[tokenizer] = longest
    except TypeError:  # not weak-referenceable: computed again next time
        pass
    return longest


def _cut_by_characters(documents: Sequence[Document], limit: int) -> Sequence[Document]:
    """``documents`` with their texts cut to ``limit`` characters in all (the first keep the most; a cut text ends in
    the truncation mark, later ones are the mark alone) and each title, url and id to ``limit``; the same list when
    nothing is that long."""

    def clip(field: str) -> str:
        return field if len(field) <= limit else field[:limit] + TRUNCATION_MARK

    if sum(len(d.text) for d in documents) <= limit and all(
        len(d.title) <= limit and len(d.url) <= limit and len(d.id) <= limit for d in documents
    ):
        return documents
    kept, left = [], limit
    for document in documents:
        text = document.text if len(document.text) <= left else document.text[:left] + TRUNCATION_MARK
        left = max(0, left - len(document.text))
        kept.append(replace(document, text=text, title=clip(document.title), url=clip(document.url),
                            id=clip(document.id)))
    return kept


def _cut(documents: Sequence[Document], text_ids: list[list[int]], allowance: int, tokenizer) -> list[Document]:
    kept: list[Document] = []
    for document, ids in zip(documents, text_ids):
        if allowance <= 0:
            break
        if len(ids) <= allowance:
            kept.append(document)
            allowance -= len(ids)
            continue
        # a cut inside a multi-byte character decodes to U+FFFD: drop that partial character
        cut_text = tokenizer.decode(ids[:allowance]).rstrip("\ufffd")
        kept.append(replace(document, text=cut_text + TRUNCATION_MARK))
        break
    return kept
