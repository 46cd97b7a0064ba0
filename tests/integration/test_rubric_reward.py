"""The rubric scorer: per-rubric verdicts from a scripted HTTP judge, the weighted mean, the extra terms, and rubric
rows read from a JSONL file (malformed ones name file:line)."""

from __future__ import annotations

import json
import re

import pytest

from rlsearch.config import JudgeConfig, RewardConfig, RubricConfig
from rlsearch.data import DatasetError, Rubric, load_qa_dataset
from rlsearch.reward import RewardScorer
from rlsearch.rollout import ToolCallRecord, Turn
from rlsearch.trajectory import RubricScore
from tests.integration.judge_stub import Scripted, answered, stub_judge

_CRITERION = re.compile(r"Criterion: (.*)")
# scores on the rubric prompt's 0-2 scale, read as 1, 0.5 and 0
REPLIES = {"names the capital": "Score: 2", "gives the population": "Score: 1", "cites a census": "Score: 0",
           "is garbage": "I refuse to grade."}
RUBRICS = [{"text": "names the capital", "weight": 2}, {"text": "gives the population"},
           {"text": "cites a census", "weight": 1.0}]
WEIGHTED_MEAN = (2 * 1.0 + 1 * 0.5 + 1 * 0.0) / 4  # 0.625


def _write_rows(path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _scorer(url: str, rubric: RubricConfig) -> RewardScorer:
    return RewardScorer(RewardConfig(scorers={"longform": "rubric"}, rubric=rubric,
                                     judge=JudgeConfig(base_url=url, model="stub-judge", cache_dir="")))


def test_weighted_mean_and_extra_terms(tmp_path) -> None:
    data = tmp_path / "longform.jsonl"
    _write_rows(data, [
        {"id": "a", "question": "Tell me about France's capital.", "data_source": "longform", "rubrics": RUBRICS},
        {"id": "b", "question": "Same, row-level scorer.", "data_source": "nq", "scorer": "rubric",
         "rubrics": [*RUBRICS, {"text": "is garbage"}]},
    ])
    examples = load_qa_dataset(data)
    assert examples[0].rubrics == (Rubric("names the capital", 2.0), Rubric("gives the population", 1.0),
                                   Rubric("cites a census", 1.0))
    assert examples[0].golden_answers == () and examples[1].scorer == "rubric"

    searched = answered('<answer>Paris, 2.1 million people <cite id="abc12345">census</cite></answer>', 0)
    searched.turns = [
        Turn(text="<call_tool>capital</call_tool>", num_tokens=4, kind="tool_call",
             tool_calls=[ToolCallRecord(name="search", query="capital", ok=True)],
             observation="<snippet id=abc12345>\nParis is the capital.\n</snippet>"),
        Turn(text="<call_tool>people</call_tool>", num_tokens=4, kind="tool_call",
             tool_calls=[ToolCallRecord(name="search", query="people", ok=True),
                         ToolCallRecord(name="search", query="census", ok=True)],
             observation="<snippet id=ffff0000>\n2.1 million.\n</snippet>"),
    ]
    unsupported = answered('Paris <cite id="nowhere1">made up</cite>', 1)  # no answer block, an unseen id
    garbage = answered("<answer>Paris</answer>", 2)

    rubric = RubricConfig(format_weight=0.1, citation_weight=0.2, search_weight=0.3, max_searches=2)
    with stub_judge(lambda prompt, attempt: Scripted(REPLIES[_CRITERION.search(prompt)[1]])) as (stub, url):
        scorer = _scorer(url, rubric)
        scorer.check(examples)
        stats = scorer.score([searched, unsupported, garbage], [examples[0], examples[0], examples[1]])
        scorer.close()

    assert searched.scores["rubric"] == pytest.approx(WEIGHTED_MEAN)
    assert searched.rubric_scores == [RubricScore("names the capital", 2.0, 1.0),
                                      RubricScore("gives the population", 1.0, 0.5),
                                      RubricScore("cites a census", 1.0, 0.0)]
    assert {key: searched.scores[key] for key in ("format", "citation", "search")} == {
        "format": 1.0, "citation": 1.0, "search": 1.0}  # 3 calls, capped at max_searches 2
    assert searched.reward == pytest.approx(0.625 + 0.1 + 0.2 + 0.3)
    assert {key: unsupported.scores[key] for key in ("format", "citation", "search")} == {
        "format": 0.0, "citation": 0.0, "search": 0.0}
    assert unsupported.reward == pytest.approx(0.625)
    assert garbage.failed.startswith("judge: rubric 3: no verdict in the reply 'I refuse to grade.'")
    assert "rubric" not in garbage.scores and garbage.rubric_scores == []
    # 3 + 3 + 4 criteria
    assert stats == {"reward/judged": 3, "reward/judge_requests": 10, "reward/judge_cache_hits": 0,
                     "reward/judge_failures": 1, "reward/judge_failovers": 0}
    # the judge saw the answer block's content, one criterion per request
    assert sum('Answer: Paris, 2.1 million people <cite id="abc12345">census</cite>\n' in p for p in stub.prompts) == 3


def test_search_term_is_a_fraction_of_max_searches() -> None:
    from rlsearch.reward.rubric import rubric_terms

    one_call = answered("<answer>x</answer>")
    one_call.turns = [Turn(text="", num_tokens=1, kind="tool_call",
                           tool_calls=[ToolCallRecord(name="search", query="q", ok=True)])]
    assert rubric_terms(one_call.model_text, one_call, RubricConfig(max_searches=4))["search"] == 0.25
    empty = answered("<answer> </answer>")  # an empty answer block is no answer: no format term
    assert rubric_terms(empty.model_text, empty, RubricConfig())["format"] == 0.0


@pytest.mark.parametrize(
    ("rubrics", "message"),
    [
        ([{"text": "ok"}, {"text": "bad", "weight": 0}],
         r":3: rubrics\[1\]: 'weight' must be a number other than 0 \(.*\); got 0"),
        ([{"weight": 1}], r":3: rubrics\[0\]: missing or empty 'text'"),
        (["just a string"], r":3: rubrics\[0\]: expected an object"),
        ([{"text": "ok", "points": 2}], r":3: rubrics\[0\]: unknown key 'points'"),
        ([], r":3: rubrics: must be a non-empty list"),
    ],
)
def test_malformed_rubric_row_names_file_and_line(tmp_path, rubrics, message) -> None:
    data = tmp_path / "bad.jsonl"
    good = {"question": "q", "data_source": "longform", "rubrics": RUBRICS}
    _write_rows(data, [good, good, {"question": "q", "data_source": "longform", "rubrics": rubrics}])
    with pytest.raises(DatasetError, match=re.escape(str(data)) + message):
        load_qa_dataset(data)


def test_rubric_scorer_on_a_row_without_rubrics_is_a_start_up_error(tmp_path) -> None:
    data = tmp_path / "plain.jsonl"
    _write_rows(data, [{"question": "q", "golden_answers": ["a"], "data_source": "longform"}])
    with pytest.raises(ValueError, match=re.escape(f"{data}:1: the rubric scorer needs the row's 'rubrics'")):
        _scorer("http://127.0.0.1:9/v1", RubricConfig()).check(load_qa_dataset(data))
