import pytest

from rlsearch.reward import (
    RewardResult,
    exact_match,
    extract_answer,
    f1_score,
    get_scorer,
    normalize_answer,
    register_scorer,
    score_response,
    substring_match,
)


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


@pytest.mark.parametrize("data_source", ["nq", "hotpotqa", "toy", "some-unknown-source"])
def test_get_scorer_defaults_to_exact_match(data_source: str) -> None:
    assert get_scorer(data_source) is score_response


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


def test_register_conflicting_scorer_raises_and_changes_nothing() -> None:
    def other(response_text: str, golden_answers, format_score: float) -> RewardResult:
        return RewardResult(reward=0.0, em=0.0, f1=0.0, has_answer=False)

    with pytest.raises(ValueError, match="'nq' already has a scorer"):
        register_scorer("test-new-source", "nq")(other)
    assert get_scorer("nq") is score_response
    assert get_scorer("test-new-source") is score_response


def test_register_scorer_needs_a_source() -> None:
    with pytest.raises(ValueError, match="at least one data_source"):
        register_scorer()
