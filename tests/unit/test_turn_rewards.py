"""Turn scorers (turn-level credit): the built-in ones on a two-search trajectory, which scorer a row gets, the
start-up check naming the key or row, and what score_turns sets and reports."""

from __future__ import annotations

import json

import pytest

from rlsearch.config import RewardConfig
from rlsearch.data import QAExample, load_qa_dataset
from rlsearch.data.dataset import DatasetError
from rlsearch.reward import ScorerError, check_turn_scorers, score_turns
from rlsearch.reward.turns import new_information, retrieved_answer, turn_scorer_name_for
from rlsearch.trajectory import ToolCallRecord, Trajectory, Turn

FIRST = "Doc 1(Title: Brakon) The rival of Brakon is Tesmir."
SECOND = "Doc 1(Title: Tesmir) The mentor of Tesmir is Olvar."


def _search(output: str, ok: bool = True) -> Turn:
    call = ToolCallRecord(name="search", query="q", ok=ok, error=None if ok else "timeout")
    return Turn(text="<search>q</search>", num_tokens=4, kind="tool_call", tool_calls=[call], observation=output,
                tool_outputs=[output])


def _trajectory(*turns: Turn, failed: str = "") -> Trajectory:
    trajectory = Trajectory(example_id="q0", group_id=0, sample_index=0, prompt_ids=[1], failed=failed)
    trajectory.turns = list(turns)
    return trajectory


def _answer() -> Turn:
    return Turn(text="<answer>Olvar</answer>", num_tokens=3, kind="answer")


def test_retrieved_answer_rewards_the_search_whose_output_holds_a_golden_answer():
    trajectory = _trajectory(_search(FIRST), _search(SECOND), _answer())
    assert retrieved_answer(trajectory, ["Olvar"]) == [0.0, 1.0, 0.0]
    assert retrieved_answer(trajectory, ["Tesmir", "nobody"]) == [1.0, 1.0, 0.0]
    # a failed call retrieved nothing, whatever its error text says
    assert retrieved_answer(_trajectory(_search("Olvar timed out", ok=False)), ["Olvar"]) == [0.0]


def test_new_information_is_the_share_of_words_no_earlier_output_held():
    trajectory = _trajectory(_search(FIRST), _search(SECOND), _search(SECOND), _answer())
    # normalised words of the first output: doc, 1title, brakon, rival, of, is, tesmir (punctuation and "the"
    # dropped): all new. The second's: doc, 1title, tesmir, mentor, of, is, olvar: mentor and olvar are new. The
    # repeated search brings nothing, and an answer turn has no output
    assert new_information(trajectory, ["Olvar"]) == pytest.approx([1.0, 2 / 7, 0.0, 0.0], abs=1e-12)


def test_a_rows_turn_scorer_is_its_own_then_its_sources_then_the_default(tmp_path):
    config = RewardConfig(turn_scorer="retrieved_answer", turn_scorers={"multihop": "new_information"})
    row = QAExample("a", "q", ("x",), "nq")
    assert turn_scorer_name_for(row, config) == "retrieved_answer"
    assert turn_scorer_name_for(QAExample("b", "q", ("x",), "multihop"), config) == "new_information"
    assert turn_scorer_name_for(QAExample("c", "q", ("x",), "multihop", turn_scorer="pkg.mod:fn"), config) == \
        "pkg.mod:fn"
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"question": "q", "golden_answers": ["a"], "turn_scorer": "new_information"}) + "\n"
                    + json.dumps({"question": "q", "golden_answers": ["a"], "turn_scorer": 3}) + "\n")
    with pytest.raises(DatasetError, match=r"rows\.jsonl:2: 'turn_scorer' must be a scorer name \(e\.g\. "
                                           r"retrieved_answer, new_information\); got 3"):
        load_qa_dataset(path)
    path.write_text(json.dumps({"question": "q", "golden_answers": ["a"], "turn_scorer": "new_information"}) + "\n")
    assert load_qa_dataset(path)[0].turn_scorer == "new_information"


def test_the_start_up_check_names_the_key_or_the_row_of_an_unknown_turn_scorer():
    rows = [QAExample("a", "q", ("x",), "nq", location="train.jsonl:1")]
    check_turn_scorers(rows, RewardConfig())
    with pytest.raises(ScorerError, match=r"^'reward\.turn_scorer': unknown turn scorer 'found_it'; known turn "
                                          r"scorers: retrieved_answer, new_information \(or package\.module:"):
        check_turn_scorers(rows, RewardConfig(turn_scorer="found_it"))
    with pytest.raises(ScorerError, match=r"^'reward\.turn_scorers\.nq': turn scorer 'no_such_module:f' cannot be "
                                          r"loaded"):
        check_turn_scorers(rows, RewardConfig(turn_scorers={"nq": "no_such_module:f"}))
    bad_row = [QAExample("b", "q", ("x",), "nq", turn_scorer="nope", location="train.jsonl:7")]
    with pytest.raises(ScorerError, match=r"^train\.jsonl:7: unknown turn scorer 'nope'"):
        check_turn_scorers(bad_row, RewardConfig())


def one_reward_for_the_whole_trajectory(trajectory, golden_answers):
    return [1.0]


def reads_a_field_turns_lack(trajectory, golden_answers):
    return [turn.answer_score for turn in trajectory.turns]


def test_the_start_up_check_scores_a_probe_and_names_a_scorer_of_the_wrong_length_or_that_fails():
    from rlsearch.reward.turns import probe_trajectory

    probe = probe_trajectory()
    assert retrieved_answer(probe, ["probe answer"]) == [1.0, 0.0, 0.0]
    assert new_information(probe, ["probe answer"]) == [1.0, 0.0, 0.0]
    rows = [QAExample("a", "q", ("x",), "nq", location="train.jsonl:1")]
    short = f"{__name__}:one_reward_for_the_whole_trajectory"
    with pytest.raises(ScorerError, match=rf"^'reward\.turn_scorer': the turn scorer '{short}' gave \[1\.0\] for a "
                                          r"probe trajectory of 3 turns; it must give one finite reward per turn$"):
        check_turn_scorers(rows, RewardConfig(turn_scorer=short))
    broken = f"{__name__}:reads_a_field_turns_lack"
    with pytest.raises(ScorerError, match=rf"^'reward\.turn_scorers\.nq': the turn scorer '{broken}' failed on a probe "
                                          r"trajectory of 3 turns: AttributeError: 'Turn' object has no attribute"):
        check_turn_scorers(rows, RewardConfig(turn_scorers={"nq": broken}))


def test_score_turns_sets_each_turns_reward_and_reports_their_mean():
    found = _trajectory(_search(FIRST), _search(SECOND), _answer())
    missed = _trajectory(_search(FIRST), _answer())
    failed = _trajectory(_search(SECOND), failed="agent: raised")
    row = QAExample("q0", "who?", ("Olvar",), "nq")
    stats = score_turns([found, missed, failed], [row] * 3, RewardConfig())
    assert [turn.reward for turn in found.turns] == [0.0, 1.0, 0.0]
    assert [turn.reward for turn in missed.turns] == [0.0, 0.0]
    assert failed.turns[0].reward is None  # left out of training: not scored, not counted
    assert stats == {"reward/turn_reward_mean": pytest.approx(1 / 5), "reward/rewarded_turns": pytest.approx(1 / 5)}


def test_a_turn_scorer_must_give_one_reward_per_turn(monkeypatch):
    from rlsearch.reward import turns

    monkeypatch.setitem(turns.TURN_SCORERS, "one_short", lambda trajectory, golden: [1.0])
    with pytest.raises(ValueError, match=r"the turn scorer 'one_short' gave 1 rewards for a trajectory of 2 turns"):
        score_turns([_trajectory(_search(FIRST), _answer())], [QAExample("q0", "q", ("a",), "nq")],
                    RewardConfig(turn_scorer="one_short"))
