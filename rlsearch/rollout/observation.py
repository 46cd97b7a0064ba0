"""Tool output -> observation text within a token budget, cutting document text but never the closing tags."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ..tools import Document, ToolProtocol

TRUNCATION_MARK = " ..."
_MAX_ATTEMPTS = 4


def fit_observation(protocol: ToolProtocol, documents: Sequence[Document], budget: int, tokenizer) -> str:
    """The protocol's observation of ``documents`` in at most ``budget`` tokens (0: no budget).

    Trailing documents whose tags alone do not fit are dropped; the texts of the rest are cut in order (the first
    documents keep the most) and re-rendered, so every item and the observation keep their closing tags. Token
    counts of parts and of the joined text can differ by a token or two at the seams, so the cut is re-checked and
    tightened.
    """

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    text = protocol.observation(documents)
    if budget <= 0 or count(text) <= budget:
        return text
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
            return text
        # items were dropped: their tags no longer cost anything, so the kept ones get that room
        num_items = len(kept)
        allowance = allowance_for(num_items)
    return best


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
