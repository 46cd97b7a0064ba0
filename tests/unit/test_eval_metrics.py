"""Eval metrics over trajectory records, the table, and the append-only results file."""

import json

import pytest

from rlsearch.config import EvalConfig, EvalSettings, ModelConfig
from rlsearch.data import DatasetError
from rlsearch.eval import OVERALL, EvalRun, ResultsFile, render_table, summarize
from rlsearch.eval.metrics import tool_failure_warning


def _record(source, example_id, sample=0, em=0.0, kinds=("tool_call", "answer"), tokens=10, time_s=1.0):
    turns = [{"kind": kind, "tool_calls": [{"name": "search"}] if kind == "tool_call" else []} for kind in kinds]
    return {
        "eval_file": f"{source}.jsonl", "data_source": source, "example_id": example_id, "sample_index": sample,
        "scores": {"em": em, "f1": em / 2, "substring_em": em, "has_answer": float("answer" in kinds)},
        "turns": turns, "response_ids": list(range(tokens)), "time_s": time_s,
    }


def test_metrics_per_data_source_and_overall():
    records = [
        _record("nq", "a", em=1.0, tokens=10),
        _record("nq", "b", kinds=("invalid_call", "tool_call", "tool_call"), tokens=30),
        _record("hotpotqa", "c", kinds=("none",), tokens=5, time_s=0.5),
    ]
    metrics = summarize(records, n_samples=1)
    assert list(metrics) == ["hotpotqa", "nq", OVERALL]
    nq = metrics["nq"]
    assert nq["questions"] == nq["samples"] == 2
    assert nq["em"] == pytest.approx(0.5) and nq["f1"] == pytest.approx(0.25)
    assert nq["answer_rate"] == pytest.approx(0.5)
    assert nq["turns"] == pytest.approx(2.5)
    assert nq["tool_calls"] == pytest.approx(1.5)
    assert nq["invalid_call_rate"] == pytest.approx(1 / 4)  # 1 invalid out of 3 valid + 1 invalid attempts
    assert nq["response_tokens"] == pytest.approx(20)
    assert nq["time_s"] == pytest.approx(2.0)
    assert metrics["hotpotqa"]["invalid_call_rate"] == 0.0 and metrics["hotpotqa"]["tool_calls"] == 0.0
    assert metrics[OVERALL]["questions"] == 3 and metrics[OVERALL]["time_s"] == pytest.approx(2.5)
    assert "pass@1" not in nq
    assert metrics[OVERALL]["failed"] == 0.0
    failed = summarize([*records, {**_record("nq", "d"), "failed": "the agent raised RuntimeError: x"}], n_samples=1)
    assert failed["nq"]["failed"] == failed[OVERALL]["failed"] == 1.0


def test_pass_at_k_and_mean_at_k():
    records = [
        _record("nq", "a", 0, em=1.0), _record("nq", "a", 1, em=0.0), _record("nq", "a", 2, em=0.0),
        _record("nq", "b", 0, em=0.0), _record("nq", "b", 1, em=0.0), _record("nq", "b", 2, em=0.0),
    ]
    overall = summarize(records, n_samples=3)[OVERALL]
    assert overall["questions"] == 2 and overall["samples"] == 6
    assert overall["pass@3"] == pytest.approx(0.5)
    assert overall["mean@3"] == pytest.approx(1 / 6) == pytest.approx(overall["em"])


def test_table_has_a_row_per_group_and_k_columns():
    records = [_record("nq", "a", 0, em=1.0), _record("nq", "a", 1)]
    table = render_table(summarize(records, n_samples=2), n_samples=2).splitlines()
    assert table[0].split()[:5] == ["data_source", "questions", "samples", "EM", "F1"]
    assert "pass@2" in table[0] and "mean@2" in table[0]
    assert [line.split()[0] for line in table[1:]] == ["nq", OVERALL]
    assert table[1].split()[3] == "0.500"


def test_results_file_drops_a_torn_last_line_and_appends_on_a_fresh_one(tmp_path):
    results = ResultsFile(tmp_path / "trajectories.jsonl")
    assert results.load() == []
    results.append([{"id": 1}, {"id": 2}])
    with results.path.open("a") as handle:
        handle.write('{"id": 3, "tur')  # killed mid-write
    assert results.load() == [{"id": 1}, {"id": 2}]
    results.append([{"id": 3}])
    assert results.load() == [{"id": 1}, {"id": 2}, {"id": 3}]


def test_results_file_names_a_corrupt_line(tmp_path):
    path = tmp_path / "trajectories.jsonl"
    path.write_text('{"id": 1}\nnot json\n')
    with pytest.raises(DatasetError, match=r"trajectories\.jsonl:2: not a JSON record"):
        ResultsFile(path).load()


def _with_calls(record, *calls):
    """The record with one tool-call turn holding ``calls`` (name, error_kind, unavailable) before its answer."""
    tool_calls = [{"name": name, "error_kind": kind, "error": kind and f"{name} broke", "unavailable": unavailable}
                  for name, kind, unavailable in calls]
    return {**record, "turns": [{"kind": "tool_call", "tool_calls": tool_calls}, *record["turns"][1:]]}


def test_tool_failures_are_counted_and_a_line_says_when_most_calls_failed():
    healthy = _with_calls(_record("nq", "a", em=1.0), ("search", None, False), ("search", "not_run", False))
    dead = [_with_calls(_record("nq", example_id), ("search", "tool_error", True), ("browse", "unknown_tool", False))
            for example_id in ("b", "c")]
    metrics = summarize([healthy, *dead], n_samples=1)
    assert metrics[OVERALL]["tool_failures"] == 2.0  # neither a call refused nor one never run reached a tool
    table = render_table(metrics, n_samples=1).splitlines()
    assert table[0].split()[9] == "tool_fail" and table[-1].split()[9] == "2"
    assert tool_failure_warning([healthy, *dead]) == (
        "WARNING: 2 of 3 tool calls failed (first: search: search broke); the scores measure the tools, not the model. "
        "Fix the tool ('tools.retriever.url' for search) and run again into the same output_dir: it generates again "
        "the 2 trajectories whose tool was unavailable")
    assert tool_failure_warning([healthy, dead[0]]) == ""  # half failed: not most


def test_a_rerun_generates_again_the_trajectories_an_unavailable_tool_spoiled(tmp_path, capsys):
    questions = tmp_path / "toy.jsonl"
    questions.write_text("".join(json.dumps({"id": example_id, "question": f"q {example_id}?", "golden_answers": ["x"],
                                             "data_source": "toy"}) + "\n" for example_id in "abc"))
    config = EvalConfig(model=ModelConfig(path="unused"), eval=EvalSettings(files=[str(questions)]),
                        output_dir=str(tmp_path / "out"))
    earlier = [_with_calls({**_record("toy", "a"), "eval_file": str(questions)}, ("search", None, False)),
               _with_calls({**_record("toy", "b"), "eval_file": str(questions)}, ("search", "timeout", True)),
               _with_calls({**_record("toy", "c"), "eval_file": str(questions)}, ("search", "tool_error", False))]
    EvalRun(config).results.append(earlier)

    rerun = EvalRun(config)
    assert [(question.example.id, sample) for question, sample in rerun.pending] == [("b", 0)]
    assert rerun.resumed == 2  # a tool error of the call itself (an empty query, ...) stays: it would come again
    assert [record["example_id"] for record in rerun.results.load()] == ["a", "c"]
    assert "1 trajectories of an earlier run met an unavailable tool" in capsys.readouterr().out
