"""Scorers by name, and which one scores a row: its own `scorer` field, else `reward.scorers[data_source]`, else the
Search-R1 default (em for Search-R1's sources). A name that is not known, and a source with no scorer, are errors."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence

from rlsearch.config import ConfigError
from rlsearch.reward.qa import RewardResult, extract_answer, score_response

RuleScorer = Callable[[str, Sequence[str], float], RewardResult]
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
# the embedded tasks' sources (rlsearch make-toy-data --task toy | multihop) are scored like Search-R1's
DEFAULT_SCORERS = {**dict.fromkeys((*SEARCH_R1_DATA_SOURCES, "multihop"), "em"), "longform": "rubric"}
JUDGED_SCORERS = ("judge", "rubric")  # scored by an LLM judge (rlsearch.reward.score), not by a RuleScorer


class ScorerError(ConfigError):
    """An unknown scorer name, or data with no scorer; the message names the source, the scorer and where (bad
    input: the CLI exits 2 with the message)."""


def score_f1(response_text: str, golden_answers: Sequence[str], format_score: float = 0.0) -> RewardResult:
    """Token F1 of the answer block as the reward (0 without one, or with an empty one); ``format_score`` is not
    used."""
    answer = extract_answer(response_text)
    if not answer:
        return RewardResult(reward=0.0, em=0.0, f1=0.0, has_answer=False)
    exact = score_response(response_text, golden_answers)
    return RewardResult(reward=exact.f1, em=exact.em, f1=exact.f1, has_answer=True)


_RULE_SCORERS: dict[str, RuleScorer] = {"em": score_response, "f1": score_f1}


def register_scorer(*names: str) -> Callable[[RuleScorer], RuleScorer]:
    """Decorator registering a rule scorer under each of ``names`` (for reward.scorers and rows' `scorer`)."""
    if not names:
        raise ValueError("register_scorer needs at least one scorer name")

    def decorator(scorer: RuleScorer) -> RuleScorer:
        for name in names:
            existing = _RULE_SCORERS.get(name, scorer)
            if existing is not scorer or name in JUDGED_SCORERS:
                raise ValueError(f"scorer name {name!r} is taken: {existing!r}")
        _RULE_SCORERS.update(dict.fromkeys(names, scorer))
        return scorer

    return decorator


def scorer_names() -> list[str]:
    return [*_RULE_SCORERS, *JUDGED_SCORERS]


def get_scorer(name: str) -> RuleScorer:
    """The rule scorer registered as ``name``, or the function ``package.module:function`` names."""
    scorer = _RULE_SCORERS.get(name)
    return scorer if scorer is not None else load_function(name, "scorer", scorer_names())


def load_function(name: str, kind: str, known: Sequence[str]) -> Callable:
    """The function ``package.module:function`` names; a `ScorerError` naming the `kind` of function and the `known`
    names when ``name`` is none of them and loads nothing."""
    module_name, _, function_name = name.partition(":")
    if not (module_name and function_name):
        raise ScorerError(f"unknown {kind} {name!r}; known {kind}s: {', '.join(known)} (or package.module:function)")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise ScorerError(f"{kind} {name!r} cannot be loaded: {error}") from error
    if not callable(function):
        raise ScorerError(f"{kind} {name!r} is not a function")
    return function


def check_scorer_name(name: str) -> None:
    """Raise `ScorerError` unless ``name`` is a judged scorer or a rule scorer that can be loaded."""
    if name not in JUDGED_SCORERS:
        get_scorer(name)


def scorer_name_for(data_source: str, row_scorer: str, configured: Mapping[str, str]) -> str:
    """The scorer name of a row: its own, else the configured one of its source, else the Search-R1 default."""
    name = row_scorer or configured.get(data_source) or DEFAULT_SCORERS.get(data_source)
    if name is None:
        raise ScorerError(
            f"data_source {data_source!r} has no scorer: set reward.scorers.{data_source}= one of "
            f"{', '.join(scorer_names())} (or give the rows a 'scorer' field)"
        )
    return name
