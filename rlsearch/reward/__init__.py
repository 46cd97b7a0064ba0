"""Rule-based rewards for QA search agents: answer extraction, EM/F1 metrics, per-dataset scorers."""

from rlsearch.reward.qa import (
    RewardResult,
    exact_match,
    extract_answer,
    f1_score,
    normalize_answer,
    score_response,
    substring_match,
)
from rlsearch.reward.registry import get_scorer, register_scorer

__all__ = [
    "RewardResult",
    "exact_match",
    "extract_answer",
    "f1_score",
    "get_scorer",
    "normalize_answer",
    "register_scorer",
    "score_response",
    "substring_match",
]
