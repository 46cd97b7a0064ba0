"""The texts of a context fold (rollout.context fold), shared by the agent loop that folds and the demonstrations
that teach a model to: the request to summarise, the summary's tags, and the question a folded segment starts from."""

from __future__ import annotations

FOLD_INSTRUCTION = (
    "Your context is nearly full. Write down everything you have found that the question still needs between "
    "<summary> and </summary>; you will go on from the question and this summary alone."
)
SUMMARY_OPEN, SUMMARY_CLOSE = "<summary>", "</summary>"
FOLDED_QUESTION = "{question}\n\nWhat you found so far:\n{summary}"


def summary_text(text: str) -> str:
    """What a fold's summary turn says: the text before its first </summary>, from the last <summary> before that
    (the whole text when it has neither tag)."""
    body = text.split(SUMMARY_CLOSE, 1)[0]
    return body.rsplit(SUMMARY_OPEN, 1)[-1].strip()
