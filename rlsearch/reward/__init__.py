"""Rewards for search agents: answer extraction, EM/F1 metrics, scorers by name (rule, LLM judge, rubrics), and turn
scorers (a reward per model turn, for turn-level credit)."""

from rlsearch.reward.qa import (
    RewardResult,
    exact_match,
    extract_answer,
    f1_score,
    normalize_answer,
    score_response,
    substring_match,
    trajectory_answer,
)
from rlsearch.reward.registry import (
    DEFAULT_SCORERS,
    JUDGED_SCORERS,
    ScorerError,
    check_scorer_name,
    get_scorer,
    register_scorer,
    score_f1,
    scorer_name_for,
    scorer_names,
)
from rlsearch.reward.score import (
    RewardScorer,
    check_scorers,
    reward_scorer,
    score_trajectories,
)
from rlsearch.reward.turns import TURN_SCORERS, check_turn_scorers, get_turn_scorer, score_turns
from rlsearch.reward.verdict import parse_verdict

__all__ = [
    "DEFAULT_SCORERS",
    "JUDGED_SCORERS",
    "TURN_SCORERS",
    "RewardResult",
    "RewardScorer",
    "ScorerError",
    "check_scorer_name",
    "check_scorers",
    "check_turn_scorers",
    "exact_match",
    "extract_answer",
    "f1_score",
    "get_scorer",
    "get_turn_scorer",
    "normalize_answer",
    "parse_verdict",
    "register_scorer",
    "reward_scorer",
    "score_f1",
    "score_response",
    "score_trajectories",
    "score_turns",
    "scorer_name_for",
    "scorer_names",
    "substring_match",
    "trajectory_answer",
]
