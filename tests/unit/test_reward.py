import pytest

from rlsearch.config import ConfigError, RewardConfig
from rlsearch.data import QAExample
from rlsearch.reward import (
    RewardResult,
    ScorerError,
    check_scorer_name,
    check_scorers,
    exact_match,
    extract_answer,
    f1_score,
    get_scorer,
    normalize_answer,
    parse_verdict,
    register_scorer,
    score_f1,
    score_response,
    score_trajectories,
    scorer_name_for,
    substring_match,
    trajectory_answer,
)
from rlsearch.rollout import Trajectory, Turn


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # Punctuation is deleted, not replaced by a space, exactly as in SQuAD / Search-R1.
        ("The  Eiffel-Tower!", "eiffeltower"),
        ("U.S.", "us"),
        ("A man, a plan, an apple.", "man plan apple"),
        ("  The \t Beatles\n", "beatles"),
        ("Theory of another anthem", "theory of another anthem"),
        ("", ""),
    ],
)
def test_normalize_answer(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


@pytest.mark.parametrize(
    ("prediction", "golden", "expected"),
    [
        ("The Beatles!", ["beatles"], 1.0),
        ("Beatle", ["Beatles"], 0.0),
        ("paris", ["London", "Paris"], 1.0),
        ("Paris, France", ["Paris"], 0.0),
        ("the", ["a"], 0.0),
    ],
)
def test_exact_match(prediction: str, golden: list[str], expected: float) -> None:
    assert exact_match(prediction, golden) == expected


@pytest.mark.parametrize(
    ("prediction", "golden", "expected"),
    [
        ("He was born in Paris, France.", ["paris"], 1.0),
        ("Parisian", ["Paris"], 1.0),
        ("London", ["Paris", "Rome"], 0.0),
        ("anything at all", ["The"], 0.0),
    ],
)
def test_substring_match(prediction: str, golden: list[str], expected: float) -> None:
    assert substring_match(prediction, golden) == expected


@pytest.mark.parametrize(
    ("prediction", "golden", "expected"),
    [
        # 3 prediction tokens after dropping "the", 2 shared: P = 2/3, R = 1, F1 = 2 * (2/3) / (5/3) = 0.8
        ("the big red dog", ["red dog"], 0.8),
        # P = 1, R = 2/3
        ("red dog", ["big red dog"], 0.8),
        # shared tokens are counted with multiplicity: P = 1/3, R = 1, F1 = 0.5
        ("dog dog dog", ["dog"], 0.5),
        # best golden answer wins: "red cat" vs "red cat house" gives P = 1, R = 2/3
        ("red cat", ["dog", "red cat house"], 0.8),
        # P = 1/2, R = 1/2
        ("red cat", ["red dog"], 0.5),
        ("blue", ["red dog"], 0.0),
        ("", ["red dog"], 0.0),
        ("the", ["red dog"], 0.0),
    ],
)
def test_f1_score(prediction: str, golden: list[str], expected: float) -> None:
    assert f1_score(prediction, golden) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer>Rome</answer> no wait <answer> Paris </answer>", "Paris"),
        ("<answer>Rome</answer> then <answer>Paris", "Rome"),
        ("<think>hmm</think><answer>Paris", None),
        ("no tags at all", None),
        ("<answer>\nline one\nline two\n</answer>", "line one\nline two"),
        ("<answer></answer>", ""),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


def test_extract_answer_with_custom_tag() -> None:
    assert extract_answer("<answer>a</answer><final>b</final>", tag="final") == "b"


def test_score_response_correct_answer() -> None:
    response = "<search>capital of France</search><answer>the Paris</answer>"
    assert score_response(response, ["Paris"]) == RewardResult(reward=1.0, em=1.0, f1=1.0, has_answer=True)


def test_score_response_wrong_answer_gets_format_score() -> None:
    result = score_response("<answer>red cat</answer>", ["red dog"], format_score=0.2)
    assert result == RewardResult(reward=0.2, em=0.0, f1=pytest.approx(0.5), has_answer=True)


def test_score_response_wrong_answer_without_format_score() -> None:
    result = score_response("<answer>red cat</answer>", ["red dog"])
    assert result == RewardResult(reward=0.0, em=0.0, f1=pytest.approx(0.5), has_answer=True)


def test_score_response_without_answer_gets_nothing() -> None:
    result = score_response("<answer>Paris", ["Paris"], format_score=0.2)
    assert result == RewardResult(reward=0.0, em=0.0, f1=0.0, has_answer=False)


@pytest.mark.parametrize("response", ["<answer></answer>", "<answer>  </answer>"])
def test_an_empty_answer_earns_no_format_credit(response: str) -> None:
    assert score_response(response, ["Paris"], format_score=0.2) == RewardResult(0.0, 0.0, 0.0, has_answer=False)
    assert score_f1(response, ["Paris"]) == RewardResult(0.0, 0.0, 0.0, has_answer=False)


def test_an_agents_answer_is_scored_and_recorded_and_an_empty_one_earns_nothing() -> None:
    rows = [_example("nq"), _example("nq"), _example("nq")]
    trajectories = [Trajectory(example_id="q1", group_id=0, sample_index=i, prompt_ids=[1]) for i in range(3)]
    for trajectory, answer in zip(trajectories, ["Paris", "Lyon", ""]):
        trajectory.agent_answer = answer
    score_trajectories(trajectories, rows, RewardConfig(format_score=0.1))
    assert [t.reward for t in trajectories] == [1.0, 0.1, 0.0]
    assert [trajectory_answer(t) for t in trajectories] == ["Paris", "Lyon", ""]
    builtin = Trajectory(example_id="q1", group_id=0, sample_index=3, prompt_ids=[1], assistant_prefix="<answer> Nice")
    builtin.turns.append(Turn(text=" city</answer>", num_tokens=3, kind="answer"))
    assert trajectory_answer(builtin) == "Nice city"


@pytest.mark.parametrize("data_source", ["nq", "hotpotqa", "toy"])
def test_search_r1_sources_default_to_exact_match(data_source: str) -> None:
    assert scorer_name_for(data_source, "", {}) == "em"
    assert get_scorer("em") is score_response


def test_configured_scorer_overrides_the_default_and_the_row_wins_over_both() -> None:
    assert scorer_name_for("nq", "", {"nq": "f1"}) == "f1"
    assert scorer_name_for("nq", "judge", {"nq": "f1"}) == "judge"
    assert scorer_name_for("mine", "rubric", {}) == "rubric"


def test_a_source_without_scorer_is_an_error_naming_it() -> None:
    with pytest.raises(ScorerError, match=r"data_source 'some-unknown-source' has no scorer: set "
                                          r"reward.scorers.some-unknown-source="):
        scorer_name_for("some-unknown-source", "", {"nq": "em"})


def test_an_unknown_scorer_name_is_an_error_listing_the_known_ones() -> None:
    with pytest.raises(ScorerError, match=r"unknown scorer 'exact'; known scorers: em, f1, .*judge, rubric"):
        check_scorer_name("exact")
    with pytest.raises(ScorerError, match=r"scorer 'no_such_module:fn' cannot be loaded"):
        get_scorer("no_such_module:fn")
    check_scorer_name("judge")  # judged scorers have no rule function, and are known
    assert get_scorer("rlsearch.reward.qa:score_response") is score_response


def test_f1_scorer_rewards_token_overlap() -> None:
    result = get_scorer("f1")("<answer>red cat</answer>", ["red dog"], 0.5)
    assert result == RewardResult(reward=0.5, em=0.0, f1=0.5, has_answer=True)
    assert get_scorer("f1")("red cat", ["red cat"], 0.5).reward == 0.0


def _example(data_source: str, scorer: str = "", rubrics: tuple = (), location: str = "data.jsonl:7") -> QAExample:
    return QAExample(id="q1", question="q?", golden_answers=("Paris",), data_source=data_source, scorer=scorer,
                     rubrics=rubrics, location=location)


def test_check_scorers_names_the_row_file_and_line() -> None:
    with pytest.raises(ScorerError, match=r"^data.jsonl:7: data_source 'mine' has no scorer"):
        check_scorers([_example("nq"), _example("mine")], RewardConfig())
    with pytest.raises(ScorerError, match=r"^data.jsonl:7: unknown scorer 'bogus'"):
        check_scorers([_example("nq", scorer="bogus")], RewardConfig())
    with pytest.raises(ScorerError, match=r"^data.jsonl:7: the rubric scorer needs the row's 'rubrics'"):
        check_scorers([_example("nq", scorer="rubric")], RewardConfig())
    check_scorers([_example("mine")], RewardConfig(scorers={"mine": "f1"}))
    with pytest.raises(ScorerError, match=r"^'reward.scorers.web': unknown scorer 'exact'"):
        check_scorers([_example("nq")], RewardConfig(scorers={"web": "exact"}))  # a key no row uses is checked too


def test_judge_scorer_without_judge_settings_fails_at_the_check() -> None:
    with pytest.raises(ConfigError, match=r"'reward.judge.base_url' and 'reward.judge.model' are needed"):
        check_scorers([_example("mine")], RewardConfig(scorers={"mine": "judge"}))


def test_row_level_scorer_is_used_for_that_row_only() -> None:
    rows = [_example("nq", scorer="f1"), _example("nq")]
    trajectories = [Trajectory(example_id="q1", group_id=0, sample_index=i, prompt_ids=[1]) for i in range(2)]
    for trajectory in trajectories:
        trajectory.assistant_prefix = "<answer>Paris France</answer>"
    stats = score_trajectories(trajectories, rows, RewardConfig(format_score=0.1))
    assert [t.reward for t in trajectories] == [pytest.approx(2 / 3), 0.1]  # f1 of "paris france"; em's format score
    assert stats["reward/judged"] == 0 and stats["reward/judge_requests"] == 0


def test_register_custom_scorer() -> None:
    @register_scorer("test-lenient-a", "test-lenient-b")
    def lenient(response_text: str, golden_answers, format_score: float) -> RewardResult:
        answer = extract_answer(response_text) or ""
        hit = substring_match(answer, golden_answers)
        return RewardResult(reward=hit, em=hit, f1=hit, has_answer=bool(answer))

    assert get_scorer("test-lenient-a") is lenient
    assert get_scorer("test-lenient-b") is lenient
    assert get_scorer("test-lenient-a")("<answer>in Paris</answer>", ["Paris"], 0.0).reward == 1.0
    assert score_response("<answer>in Paris</answer>", ["Paris"]).reward == 0.0
    assert scorer_name_for("mine", "", {"mine": "test-lenient-a"}) == "test-lenient-a"


@pytest.mark.parametrize("taken", ["em", "judge"])
def test_register_conflicting_scorer_raises_and_changes_nothing(taken: str) -> None:
    def other(response_text: str, golden_answers, format_score: float) -> RewardResult:
        return RewardResult(reward=0.0, em=0.0, f1=0.0, has_answer=False)

    with pytest.raises(ValueError, match=f"scorer name '{taken}' is taken"):
        register_scorer("test-new-name", taken)(other)
    assert get_scorer("em") is score_response
    with pytest.raises(ScorerError):
        get_scorer("test-new-name")


def test_register_scorer_needs_a_name() -> None:
    with pytest.raises(ValueError, match="at least one scorer name"):
        register_scorer()


@pytest.mark.parametrize(
    ("reply", "scale", "expected"),
    [
        ("Verdict: correct", None, 1.0),
        ("The answer names the same city.\nVerdict: **Incorrect**.", None, 0.0),
        ("CORRECT", None, 1.0),
        ("yes", None, 1.0),
        ("No.", None, 0.0),
        ('{"correct": true}', None, 1.0),
        ('Here you go: {"verdict": "wrong", "why": "other city"}', None, 0.0),
        ('{"score": 7}', None, 0.7),
        ("Score: 0.8", None, 0.8),
        ("8/10", None, 0.8),
        ("3 out of 10", None, 0.3),
        ("<think>maybe it is correct</think>\nVerdict: incorrect", None, 0.0),
        ("Score: 2", 2.0, 1.0),
        ("Score: 1", 2.0, 0.5),
        ("partially correct", 2.0, 0.5),
        ("Verdict: correct\nVerdict: wrong", None, 0.0),  # the last labelled line wins
    ],
)
def test_parse_verdict_accepts(reply: str, scale: float | None, expected: float) -> None:
    assert parse_verdict(reply, scale) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("reply", "scale"),
    [("", None), ("I think the agent did fine overall", None), ("Score: 11", None), ("Score: 3", 2.0),
     ("12/10", None), ('{"reason": "no verdict key"} maybe', None), ("ERROR", None)],
)
def test_parse_verdict_rejects(reply: str, scale: float | None) -> None:
    assert parse_verdict(reply, scale) is None


def test_search_score_rewards_searching_with_valid_calls_only() -> None:
    from rlsearch.trajectory import ToolCallRecord, Turn

    search = Turn(text="<search>x</search>", num_tokens=3, kind="tool_call",
                  tool_calls=[ToolCallRecord(name="search", query="x", ok=True)])
    invalid = Turn(text="<search>x</answer>", num_tokens=3, kind="invalid_call", error_kind="unparseable")
    answer = Turn(text="<answer>Rome</answer>", num_tokens=3, kind="answer")
    cases = [  # turns, reward, valid_search
        ((search, answer), 0.1 + 0.25, 1.0),  # wrong but well-formed answer, after a valid search
        ((search, invalid, answer), 0.1, 0.0),  # an invalid call forfeits the search term
        ((answer,), 0.1, 0.0),  # no search
        ((search,), 0.25, 1.0),  # searched, never answered
    ]
    trajectories = []
    for turns, _, _ in cases:
        trajectory = Trajectory(example_id="q1", group_id=0, sample_index=len(trajectories), prompt_ids=[1])
        trajectory.turns = list(turns)
        trajectories.append(trajectory)
    agent_scored = Trajectory(example_id="q1", group_id=0, sample_index=9, prompt_ids=[1], agent_reward=0.5)
    agent_scored.turns = [search, answer]
    score_trajectories([*trajectories, agent_scored], [_example("nq")] * 5,
                       RewardConfig(format_score=0.1, search_score=0.25))
    for trajectory, (_, reward, valid_search) in zip(trajectories, cases):
        assert trajectory.reward == pytest.approx(reward)
        assert trajectory.scores["valid_search"] == valid_search
    assert agent_scored.reward == 0.5  # a reward the agent returned is taken as it is
