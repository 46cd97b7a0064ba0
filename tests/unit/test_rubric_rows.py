"""Long-form rows whose rubrics come in DR Tulu's `ground_truth` form or RaR's `rubric` lists, read as they are onto
the rubric scorer's `QAExample.rubrics`, and malformed ones named by file:line and what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlsearch.data import DatasetError, QAExample, Rubric, load_qa_dataset

QUESTION = "What causes scurvy and how is it treated?"
# RaR's rubric items (anisha2102/RaR-Medicine-20k-o3-mini): description, title, weight; pitfalls weigh < 0
RAR_RUBRIC = [
    {"description": "Essential Criteria: Names vitamin C deficiency as the cause.", "title": "Cause", "weight": 5},
    {"description": "Important Criteria: Gives vitamin C supplements as the treatment.", "title": "Treatment",
     "weight": 3},
    {"description": "Pitfall Criteria: Blames a bacterial infection.", "title": "Infection myth", "weight": -1},
]
PARSED = (Rubric("Essential Criteria: Names vitamin C deficiency as the cause.", 5.0),
          Rubric("Important Criteria: Gives vitamin C supplements as the treatment.", 3.0),
          Rubric("Pitfall Criteria: Blames a bacterial infection.", -1.0))


def dr_tulu_row(rubrics: object = RAR_RUBRIC, **fields: object) -> dict:
    """A row as DR Tulu's rl/open-instruct/convert_rar_data.py writes it."""
    return {"source": "RaR-Medicine-20k-o3-mini-converted", "question_type": "long_form",
            "messages": [{"content": QUESTION, "role": "user"}],
            "ground_truth": json.dumps({"query": QUESTION, "rubrics": rubrics}), "dataset": "general_rubric",
            **fields}


def rar_row(rubric: object = RAR_RUBRIC) -> dict:
    return {"question": QUESTION, "reference_answer": "Vitamin C deficiency; vitamin C.", "rubric": rubric,
            "rubric_count": 3}


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_dr_tulu_rows_are_read_as_they_are(tmp_path: Path) -> None:
    wrapped = {"id": "w", "dataset": "general_rubric",  # open-instruct keeps it in a one-item list, "Question" keyed
               "ground_truth": [json.dumps({"Question": "Why?", "rubrics": [{"description": "Says why."}]})]}
    as_object = {"id": "o", "question": "Own question", "data_source": "mine", "scorer": "judge",
                 "golden_answers": ["x"], "ground_truth": {"query": "ignored", "rubrics": [{"description": "d"}]}}
    path = write_rows(tmp_path / "drtulu.jsonl", [dr_tulu_row(), wrapped, as_object])
    first, second, third = load_qa_dataset(path)
    assert first == QAExample(id="drtulu-0", question=QUESTION, golden_answers=(),
                              data_source="RaR-Medicine-20k-o3-mini-converted", scorer="rubric", rubrics=PARSED)
    assert (second.question, second.rubrics, second.scorer, second.data_source) == (
        "Why?", (Rubric("Says why.", 1.0),), "rubric", "unknown")
    # the row's own question, data source and scorer win
    assert (third.question, third.data_source, third.scorer, third.rubrics) == (
        "Own question", "mine", "judge", (Rubric("d", 1.0),))


def test_rar_rows_are_read_as_they_are(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "rar.jsonl", [{**rar_row(), "source": "only DR Tulu's rows name it so"}])
    assert load_qa_dataset(path, default_data_source="rar") == [QAExample(
        id="rar-0", question=QUESTION, golden_answers=(), data_source="rar", scorer="rubric", rubrics=PARSED)]


def test_dr_tulu_parquet_rows_and_their_errors_name_the_row(tmp_path: Path) -> None:
    import pyarrow
    import pyarrow.parquet

    path = tmp_path / "drtulu.parquet"
    rows = [dr_tulu_row(), dr_tulu_row([{"title": "no description", "weight": 1}])]
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows[:1]), path)
    assert load_qa_dataset(path)[0].rubrics == PARSED
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    with pytest.raises(DatasetError) as error:
        load_qa_dataset(path)
    assert str(error.value) == (f"{path}: row 2: ground_truth.rubrics[0]: missing or empty 'description'; give the "
                                "criterion as a non-empty string")


def test_rlsearch_rows_take_a_negative_weight_too(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "own.jsonl", [{"question": "q", "data_source": "longform", "rubrics": [
        {"text": "names the cause", "weight": 2}, {"text": "invents a date", "weight": -0.5}]}])
    example = load_qa_dataset(path)[0]
    assert example.rubrics == (Rubric("names the cause", 2.0), Rubric("invents a date", -0.5))
    assert example.scorer == ""  # rlsearch's own rows take their scorer from reward.scorers


WEIGHT = ("'weight' must be a number other than 0 (a negative one marks a pitfall, which subtracts when the answer "
          "meets it)")


@pytest.mark.parametrize(("row", "message"), [
    (dr_tulu_row([RAR_RUBRIC[0], {"title": "Treatment", "weight": 3}]),
     "ground_truth.rubrics[1]: missing or empty 'description'; give the criterion as a non-empty string"),
    (dr_tulu_row([{"description": "  ", "weight": 3}]),
     "ground_truth.rubrics[0]: missing or empty 'description'; give the criterion as a non-empty string"),
    (dr_tulu_row([{"description": "d", "weight": "heavy"}]), f"ground_truth.rubrics[0]: {WEIGHT}; got 'heavy'"),
    (dr_tulu_row([]), 'ground_truth.rubrics: must be a non-empty list of {"description", "weight"} objects; got []'),
    (dr_tulu_row(["just text"]),
     "ground_truth.rubrics[0]: expected an object {\"description\": ..., \"weight\": ...}, got 'just text'"),
    ({**dr_tulu_row(), "ground_truth": "Paris"},
     "'ground_truth' of a general_rubric row must be a JSON object with 'query' and 'rubrics' (as DR Tulu writes "
     "it: json.dumps({\"query\": ..., \"rubrics\": [...]})); got 'Paris'"),
    (rar_row([RAR_RUBRIC[0], {"description": "d", "weight": None}]), f"rubric[1]: {WEIGHT}; got None"),
    (rar_row([{"description": "d", "weight": 0}]), f"rubric[0]: {WEIGHT}; got 0"),
    (rar_row([]), 'rubric: must be a non-empty list of {"description", "weight"} objects; got []'),
    (rar_row("Essential Criteria: names the cause"),
     "rubric: must be a non-empty list of {\"description\", \"weight\"} objects; got 'Essential Criteria: names "
     "the cause'"),
    (rar_row([{"description": "Pitfall Criteria: blames bacteria.", "weight": -1}]),
     "rubric: no rubric has a positive weight; give at least one (the score is divided by the sum of the positive "
     "weights)"),
    ({**rar_row(), "rubrics": [{"text": "t"}]}, "the row gives rubrics as 'rubrics' and 'rubric'; keep one"),
    ({**dr_tulu_row(), "rubric": RAR_RUBRIC}, "the row gives rubrics as 'rubric' and 'ground_truth'; keep one"),
    ({**dr_tulu_row(), "ground_truth": json.dumps({"rubrics": RAR_RUBRIC})},
     "missing or empty 'question' (or 'extra_info.question', or the 'query' of DR Tulu's 'ground_truth'); give a "
     "non-empty string"),
])
def test_a_malformed_rubric_row_names_its_file_line_and_what_is_wrong(tmp_path: Path, row: dict,
                                                                      message: str) -> None:
    path = write_rows(tmp_path / "rows.jsonl", [dr_tulu_row(), row])
    with pytest.raises(DatasetError) as error:
        load_qa_dataset(path)
    assert str(error.value) == f"{path}:2: {message}"


def test_a_short_form_dr_tulu_row_is_no_rubric_row(tmp_path: Path) -> None:
    """DR Tulu's short-form rows carry their answer as a plain ground_truth: not rubrics, so they need golden
    answers here."""
    path = write_rows(tmp_path / "short.jsonl", [{"question": "q", "ground_truth": "Paris", "dataset": "re_search"}])
    with pytest.raises(DatasetError, match=r"short\.jsonl:1: missing golden answers"):
        load_qa_dataset(path)
