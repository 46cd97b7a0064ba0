"""Maps a dataset's ``data_source`` to the scorer that computes its reward."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rlsearch.reward.qa import RewardResult, score_response

Scorer = Callable[[str, Sequence[str], float], RewardResult]
"""(response_text, golden_answers, format_score) -> RewardResult"""

SEARCH_R1_DATA_SOURCES = (
    "nq",
    "triviaqa",
    "popqa",
    "hotpotqa",
    "2wikimultihopqa",
    "musique",
    "bamboogle",
    "toy",
)

_SCORERS: dict[str, Scorer] = {}


def register_scorer(*data_sources: str) -> Callable[[Scorer], Scorer]:
    """Decorator registering a scorer for each of ``data_sources``; a source can have only one scorer."""
    if not data_sources:
        raise ValueError("register_scorer needs at least one data_source")

    def decorator(scorer: Scorer) -> Scorer:
        for source in data_sources:
            existing = _SCORERS.get(source, scorer)
            if existing is not scorer:
                raise ValueError(f"data_source {source!r} already has a scorer: {existing!r}")
        _SCORERS.update(dict.fromkeys(data_sources, scorer))
        return scorer

    return decorator


def get_scorer(data_source: str) -> Scorer:
    """The scorer registered for ``data_source``, else the default exact-match scorer."""
    return _SCORERS.get(data_source, score_response)


register_scorer(*SEARCH_R1_DATA_SOURCES)(score_response)
