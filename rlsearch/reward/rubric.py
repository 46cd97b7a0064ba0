"""The rubric scorer's reward (DR Tulu style long-form answers): the weighted per-rubric judge scores plus weighted
format, citation and search terms, each in [0, 1]."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rlsearch.reward.qa import extract_answer

if TYPE_CHECKING:
    from rlsearch.config import RubricConfig
    from rlsearch.data import Rubric
    from rlsearch.trajectory import Trajectory

# ids the tools show the model (call_tool protocol: <snippet id=...>, <webpage id=...>) and the answer's citations
_SHOWN_ID = re.compile(r"<(?:snippet|webpage)\s+id=[\"']?([^\"'\s>]+)")
_CITED_IDS = re.compile(r"<cite\s+id=[\"']?([^\"'>]+)[\"']?\s*>")


def weighted_rubric_mean(rubrics: Sequence[Rubric], scores: Sequence[float]) -> float:
    """The static rubrics' score: sum(weight * score) / the sum of the positive weights, the weighted mean when no
    weight is negative; a negative rubric (a pitfall, RaR's rows) subtracts when the answer meets it."""
    return _weighted_sum(rubrics, scores) / _positive_weight(rubrics)


def dr_tulu_rubric_score(rubrics: Sequence[Rubric], scores: Sequence[float]) -> float:
    """DR Tulu's rubric reward: sum(weight * score) / max(sum of the positive weights, 1). A negative rubric (weight
    -1: a mistake the answer makes) subtracts, so the score can be below 0."""
    return _weighted_sum(rubrics, scores) / max(_positive_weight(rubrics), 1.0)


def _weighted_sum(rubrics: Sequence[Rubric], scores: Sequence[float]) -> float:
    return sum(rubric.weight * score for rubric, score in zip(rubrics, scores, strict=True))


def _positive_weight(rubrics: Sequence[Rubric]) -> float:
    return sum(rubric.weight for rubric in rubrics if rubric.weight > 0)


def rubric_terms(response_text: str, trajectory: Trajectory, config: RubricConfig) -> dict[str, float]:
    """format: a non-empty <answer> block is present; citation: the answer (the whole response without a block)
    cites with ``<cite id="a,b">`` at least one id a tool showed; search: min(tool calls, max_searches) /
    max_searches."""
    answer = extract_answer(response_text)
    shown = {match for turn in trajectory.turns for match in _SHOWN_ID.findall(turn.observation or "")}
    cited = {part.strip() for group in _CITED_IDS.findall(answer or response_text) for part in group.split(",")}
    return {
        "format": float(bool(answer)),
        "citation": float(bool(cited & shown)),
        "search": min(len(trajectory.tool_calls), config.max_searches) / config.max_searches,
    }


def rubric_reward(rubric_mean: float, terms: dict[str, float], config: RubricConfig) -> float:
    return (rubric_mean + config.format_weight * terms["format"] + config.citation_weight * terms["citation"]
            + config.search_weight * terms["search"])
