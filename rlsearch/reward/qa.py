"""Answer normalisation, QA metrics (EM, substring match, token F1) and the default response scorer."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlsearch.trajectory import Trajectory

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD / Search-R1 normalisation: lowercase, drop punctuation and articles, collapse whitespace.

    Punctuation is deleted rather than replaced by a space (as in the reference implementation),
    so "Eiffel-Tower" becomes "eiffeltower" and "U.S." becomes "us".
    """
    text = text.lower().translate(_PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _normalized_golden(golden_answers: Sequence[str]) -> list[str]:
    # A golden answer that normalises to "" (e.g. "the") would be a substring of every prediction.
    return [norm for norm in (normalize_answer(answer) for answer in golden_answers) if norm]


def exact_match(prediction: str, golden_answers: Sequence[str]) -> float:
    """1.0 if the normalised prediction equals any normalised golden answer, else 0.0."""
    normalized_prediction = normalize_answer(prediction)
    return float(normalized_prediction in _normalized_golden(golden_answers))


def substring_match(prediction: str, golden_answers: Sequence[str]) -> float:
    """1.0 if any normalised golden answer is a substring of the normalised prediction, else 0.0."""
    normalized_prediction = normalize_answer(prediction)
    return float(any(golden in normalized_prediction for golden in _normalized_golden(golden_answers)))


def _token_f1(prediction_tokens: list[str], golden_tokens: list[str]) -> float:
    overlap = sum((Counter(prediction_tokens) & Counter(golden_tokens)).values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(prediction_tokens)
    recall = overlap / len(golden_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, golden_answers: Sequence[str]) -> float:
    """Token-level F1 between the normalised prediction and the best-matching golden answer."""
    prediction_tokens = normalize_answer(prediction).split()
    if not prediction_tokens:
        return 0.0
    return max(
        (_token_f1(prediction_tokens, golden.split()) for golden in _normalized_golden(golden_answers)),
        default=0.0,
    )


def extract_answer(text: str, tag: str = "answer") -> str | None:
    """Content of the last complete ``<tag>...</tag>`` block, stripped; None if there is none."""
    pattern = re.compile(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", re.DOTALL)
    matches = pattern.findall(text)
    return matches[-1].strip() if matches else None


@dataclass(frozen=True)
class RewardResult:
    reward: float
    em: float
    f1: float
    has_answer: bool


def score_response(
    response_text: str, golden_answers: Sequence[str], format_score: float = 0.0
) -> RewardResult:
    """Search-R1 outcome reward: 1.0 for an exact match, ``format_score`` for a wrong but present answer (an empty
    answer block is no answer: it earns nothing)."""
    answer = extract_answer(response_text)
    if not answer:
        return RewardResult(reward=0.0, em=0.0, f1=0.0, has_answer=False)
    em = exact_match(answer, golden_answers)
    reward = 1.0 if em else format_score
    return RewardResult(reward=reward, em=em, f1=f1_score(answer, golden_answers), has_answer=True)


def trajectory_answer(trajectory: Trajectory) -> str | None:
    """What a trajectory answered: a user agent's returned answer, else the model's last <answer> block."""
    if trajectory.agent_answer is not None:
        return trajectory.agent_answer
    return extract_answer(trajectory.model_text)
