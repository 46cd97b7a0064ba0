"""The evolving rubric buffer (DR Tulu's RLER): add, the std filter, the cap, persistence, and DR Tulu's reward."""

from __future__ import annotations

import json

import pytest

from rlsearch.config import ConfigError, load_train_config
from rlsearch.data import Rubric
from rlsearch.reward.evolving import EvolvingRubric, FilterResult, RubricBuffer
from rlsearch.reward.rubric import dr_tulu_rubric_score, weighted_rubric_mean

DATASET = (Rubric("names the three causes", 2.0), Rubric("cites a primary source", 1.0))


def generated(*texts: str, weight: float = 1.0) -> list[EvolvingRubric]:
    return [EvolvingRubric(text, weight) for text in texts]


def test_add_stamps_the_step_and_skips_what_the_question_already_has() -> None:
    buffer = RubricBuffer()
    rubrics = buffer.question("q1", DATASET)
    added = buffer.add("q1", [*generated("Mentions 1789", "names  the THREE causes"),
                              EvolvingRubric("invents a date", -1.0), EvolvingRubric("mentions 1789 ", 1.0)], step=4)
    assert added == 2  # the persistent rubric and the repeated one (case and spacing aside) are skipped
    assert [(rubric.text, rubric.weight, rubric.added_step) for rubric in rubrics.active] == [
        ("Mentions 1789", 1.0, 4), ("invents a date", -1.0, 4)]
    assert rubrics.scoring_rubrics() == [*DATASET, Rubric("Mentions 1789", 1.0), Rubric("invents a date", -1.0)]
    assert buffer.question("q1", ()) is rubrics  # made once; later calls do not reset it


def test_zero_std_rubrics_leave_and_never_come_back_persistent_ones_stay() -> None:
    buffer = RubricBuffer()
    rubrics = buffer.question("q1", DATASET)
    buffer.add("q1", generated("flat", "splits", "one score"), step=1)
    result = buffer.filter("q1", {"flat": [1.0, 1.0, 1.0], "splits": [0.0, 0.5, 1.0], "one score": [1.0],
                                  "names the three causes": [1.0, 1.0, 1.0]}, step=1)
    assert result == FilterResult(deactivated_zero_std=1, deactivated_over_cap=0)
    assert [rubric.text for rubric in rubrics.active] == ["splits", "one score"]  # fewer than 2 scores: no std yet
    assert rubrics.persistent == list(DATASET)  # zero std, but persistent rubrics are never pruned
    assert [(rubric.text, rubric.std, rubric.removed_step) for rubric in rubrics.inactive] == [("flat", 0.0, 1)]
    assert rubrics.active[0].std == pytest.approx(0.408248290463863)  # pstdev of 0, 0.5, 1
    assert buffer.add("q1", generated("FLAT"), step=2) == 0  # an inactive rubric is not added again


def test_at_most_max_active_stay_the_most_discriminative() -> None:
    buffer = RubricBuffer(max_active=2)
    rubrics = buffer.question("q1", ())
    buffer.add("q1", generated("a", "b", "c", "d"), step=3)
    # std: a 0.5, b 0.25, c 0.5, d 0.25 -> keep a and c; b and d go, the oldest first among equals
    result = buffer.filter("q1", {"a": [0.0, 1.0], "b": [0.5, 1.0], "c": [1.0, 0.0], "d": [0.0, 0.5]}, step=3)
    assert result == FilterResult(0, 2) and result.deactivated == 2
    assert [rubric.text for rubric in rubrics.active] == ["a", "c"]
    assert [rubric.text for rubric in rubrics.inactive] == ["b", "d"]


def test_over_the_cap_ties_go_oldest_first() -> None:
    buffer = RubricBuffer(max_active=1)
    rubrics = buffer.question("q1", ())
    buffer.add("q1", generated("old"), step=1)
    buffer.add("q1", generated("new"), step=2)
    buffer.filter("q1", {"old": [0.0, 1.0], "new": [1.0, 0.0]}, step=2)
    assert [rubric.text for rubric in rubrics.active] == ["new"]


def test_without_persistent_the_dataset_rubrics_are_active_and_prunable() -> None:
    buffer = RubricBuffer(persistent=False)
    rubrics = buffer.question("q1", DATASET)
    assert rubrics.persistent == [] and [(rubric.origin, rubric.weight) for rubric in rubrics.active] == [
        ("dataset", 2.0), ("dataset", 1.0)]
    buffer.filter("q1", {"names the three causes": [0.5, 0.5], "cites a primary source": [0.0, 1.0]}, step=7)
    assert [rubric.text for rubric in rubrics.inactive] == ["names the three causes"]


def test_state_round_trips_through_json_exactly() -> None:
    buffer = RubricBuffer(max_active=2)
    buffer.question("q1", DATASET)
    buffer.question("q2", ())
    buffer.add("q1", [EvolvingRubric("a", 1.0, title="A"), EvolvingRubric("b", -1.0)], step=1)
    buffer.add("q1", generated("c"), step=2)
    buffer.filter("q1", {"a": [0.0, 1.0], "b": [0.0, 0.0], "c": [1.0, 0.5]}, step=2)
    state = json.loads(json.dumps(buffer.to_state()))
    restored = RubricBuffer.from_state(state, max_active=2)
    assert restored.questions == buffer.questions
    assert restored.to_state() == buffer.to_state()
    assert [rubric.text for rubric in restored.questions["q1"].inactive] == ["b"]
    assert restored.questions["q1"].active[0] == EvolvingRubric("a", 1.0, title="A", added_step=1, std=0.5)


def test_max_active_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_active must be >= 1; got 0"):
        RubricBuffer(max_active=0)


@pytest.mark.parametrize(("weights", "scores", "expected"), [
    ((2.0, 1.0), (1.0, 0.5), (2 * 1.0 + 1 * 0.5) / 3),  # 0.8333...: positive weights only, the weighted mean
    ((2.0, 1.0, -1.0), (1.0, 0.5, 1.0), (2.5 - 1.0) / 3),  # 0.5: a negative rubric subtracts, not in the denominator
    ((1.0, -1.0), (0.0, 1.0), -1.0),  # below 0: the answer makes the mistake and meets nothing
    ((0.5,), (1.0,), 0.5),  # the denominator is at least 1 (the static scorer's mean would say 1.0)
    ((-1.0,), (0.5,), -0.5),  # negatives only: divided by 1
])
def test_dr_tulu_rubric_score(weights, scores, expected) -> None:
    rubrics = [Rubric(f"r{index}", weight) for index, weight in enumerate(weights)]
    assert dr_tulu_rubric_score(rubrics, scores) == pytest.approx(expected)


@pytest.mark.parametrize(("weights", "scores", "expected"), [
    ((2.0, 1.0), (1.0, 0.5), (2 * 1.0 + 1 * 0.5) / 3),  # the weighted mean
    ((5.0, 3.0, -1.0), (1.0, 0.5, 1.0), (5 + 1.5 - 1) / 8),  # 0.6875: RaR's pitfall met subtracts
    ((5.0, -2.0), (0.0, 1.0), -2 / 5),  # below 0
    ((0.5,), (1.0,), 1.0),  # no floor of 1 on the denominator (DR Tulu's score says 0.5)
])
def test_the_static_rubric_score_divides_by_the_positive_weights(weights, scores, expected) -> None:
    rubrics = [Rubric(f"r{index}", weight) for index, weight in enumerate(weights)]
    assert weighted_rubric_mean(rubrics, scores) == pytest.approx(expected)


@pytest.mark.parametrize(("overrides", "message"), [
    (["reward.rubric.evolve.enabled=true"],
     r"'reward\.rubric\.evolve\.enabled' needs a generator model: list it in 'reward\.rubric\.evolve\.endpoints'"),
    (["reward.rubric.evolve.endpoints=[{url: 'http://a/v1'}]"],
     r"'reward\.rubric\.evolve\.endpoints\[0\]\.model' is empty"),
    (["reward.rubric.evolve.max_active_rubrics=0"], r"'reward\.rubric\.evolve\.max_active_rubrics' must be > 0"),
])
def test_bad_evolving_rubric_keys_stop_the_start_naming_the_key(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_train_config(None, overrides)


@pytest.mark.parametrize("overrides", [
    ["reward.rubric.evolve.enabled=true", "reward.judge.base_url=http://j/v1", "reward.judge.model=m"],
    ["reward.rubric.evolve.enabled=true", "reward.rubric.evolve.endpoints=[{url: 'http://g/v1', model: g}]"],
])
def test_evolving_rubrics_with_a_generator_model_load(overrides) -> None:
    assert load_train_config(None, overrides).reward.rubric.evolve.enabled


def test_evolving_rubric_options_load_with_dr_tulus_defaults() -> None:
    evolve = load_train_config(None, ["reward.rubric.evolve.max_active_rubrics=3"]).reward.rubric.evolve
    assert (evolve.enabled, evolve.max_active_rubrics, evolve.use_full_responses_for_adaptive_rubric,
            evolve.use_static_rubrics_as_persistent_rubrics, evolve.max_tokens) == (False, 3, True, True, 2048)
