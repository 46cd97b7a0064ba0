"""`make-toy-data --task longform`: long-form questions over the toy corpus whose rows carry rubrics (a fact and its
citation per entity, a pitfall per look-alike), what it writes, its determinism, the loader reading it back, and the
command line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlsearch.cli import main
from rlsearch.data import Rubric, load_qa_dataset, make_longform_data
from rlsearch.data.demos import bm25_search
from rlsearch.reward.registry import scorer_name_for
from tests.jsonl import read_jsonl

OPTIONS = dict(seed=3, num_questions=10, facts_per_question=3, test_fraction=0.2, distractors_per_entity=1)
_FACT = re.compile(r'^Answers "(?P<question>[^"]+)" with (?P<answer>.+) and cites the passage that says so, '
                   r'<cite id="(?P<id>\d+)">\.$')
_PITFALL = re.compile(r'^Answers "(?P<question>[^"]+)" with (?P<answer>.+), a fact of (?P<lookalike>.+) \(a passage '
                      r"that only mentions (?P<entity>.+)\)\.$")


@pytest.fixture(scope="module")
def longform(tmp_path_factory) -> Path:
    return make_longform_data(tmp_path_factory.mktemp("longform"), **OPTIONS).corpus.parent


def test_it_writes_the_questions_passages_and_rubrics(longform: Path) -> None:
    train, test = read_jsonl(longform / "train.jsonl"), read_jsonl(longform / "test.jsonl")
    corpus = {row["id"]: row["contents"] for row in read_jsonl(longform / "corpus.jsonl")}
    assert (len(train), len(test), len(corpus)) == (8, 2, 10 * 3 * 2)  # 30 entities, each with one look-alike
    rows = train + test
    assert sorted(row["id"] for row in rows) == sorted(f"longform-{index}" for index in range(10))
    for row in rows:
        assert set(row) == {"id", "question", "data_source", "rubrics", "metadata"}
        assert row["data_source"] == "longform"
        metadata = row["metadata"]
        assert len(set(metadata["passage_ids"])) == 3  # three facts from three passages
        assert all(title in row["question"] for title in metadata["entities"])
        assert [rubric["weight"] for rubric in row["rubrics"]] == [1.0, -1.0] * 3
        for (fact, pitfall), entity, passage_id, answer in zip(
                zip(row["rubrics"][::2], row["rubrics"][1::2]), metadata["entities"], metadata["passage_ids"],
                metadata["answers"]):
            fact, pitfall = _FACT.match(fact["text"]), _PITFALL.match(pitfall["text"])
            assert (fact["answer"], fact["id"], pitfall["entity"]) == (answer, passage_id, entity)
            assert fact["question"] == pitfall["question"] and fact["question"] in row["question"]
            assert entity in corpus[passage_id] and answer in corpus[passage_id]
            # the pitfall's answer is the look-alike's: a passage that mentions the entity, not the entity's own
            lookalike = next(text for text in corpus.values() if text.startswith(f'"{pitfall["lookalike"]}"\n'))
            assert entity in lookalike and pitfall["answer"] in lookalike
            assert pitfall["answer"] not in corpus[passage_id]


def test_each_entity_is_found_by_searching_its_name(longform: Path) -> None:
    """The facts are retrievable: the local BM25 index returns each entity's passage among its look-alikes."""
    rows = read_jsonl(longform / "train.jsonl") + read_jsonl(longform / "test.jsonl")
    entities = [entity for row in rows for entity in row["metadata"]["entities"]]
    passages = [passage_id for row in rows for passage_id in row["metadata"]["passage_ids"]]
    hits = bm25_search(longform / "corpus.jsonl")(entities, 2)
    assert all(passage_id in [hit["id"] for hit in found] for passage_id, found in zip(passages, hits))


def test_the_same_seed_writes_the_same_bytes(tmp_path: Path, longform: Path) -> None:
    again = make_longform_data(tmp_path / "again", **OPTIONS).corpus.parent
    other = make_longform_data(tmp_path / "other", **{**OPTIONS, "seed": 4}).corpus.parent
    for name in ("corpus.jsonl", "train.jsonl", "test.jsonl", "README.txt"):
        assert (again / name).read_bytes() == (longform / name).read_bytes()
    assert (other / "train.jsonl").read_bytes() != (longform / "train.jsonl").read_bytes()


def test_the_loader_reads_it_back_for_the_rubric_scorer(longform: Path) -> None:
    rows = read_jsonl(longform / "train.jsonl")
    examples = load_qa_dataset(longform / "train.jsonl")
    assert [example.id for example in examples] == [row["id"] for row in rows]
    for example, row in zip(examples, rows):
        assert example.rubrics == tuple(Rubric(rubric["text"], rubric["weight"]) for rubric in row["rubrics"])
        assert (example.question, example.golden_answers, example.data_source) == (row["question"], (), "longform")
    assert scorer_name_for("longform", "", {}) == "rubric"  # by default; reward.scorers.longform may say otherwise
    assert scorer_name_for("longform", "", {"longform": "judge"}) == "judge"


def test_without_look_alikes_there_are_no_pitfalls(tmp_path: Path) -> None:
    paths = make_longform_data(tmp_path, num_questions=3, facts_per_question=2, distractors_per_entity=0)
    rows = read_jsonl(paths.train) + read_jsonl(paths.test)
    assert len(read_jsonl(paths.corpus)) == 6
    assert [[rubric["weight"] for rubric in row["rubrics"]] for row in rows] == [[1.0, 1.0]] * 3


def test_the_command_line(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cli"
    assert main(["make-toy-data", "--task", "longform", "--out", str(out), "--num-questions", "4",
                 "--facts-per-question", "2", "--seed", "3"]) == 0
    assert [len(read_jsonl(out / name)) for name in ("train.jsonl", "test.jsonl")] == [3, 1]
    assert not (out / "sft.jsonl").exists()
    assert json.loads((out / "test.jsonl").read_text().splitlines()[0])["data_source"] == "longform"
    assert main(["make-toy-data", "--task", "longform", "--out", str(out), "--learnable", "--hops", "2"]) == 2
    assert main(["make-toy-data", "--out", str(out), "--num-questions", "4"]) == 2
    assert main(["make-toy-data", "--task", "longform", "--out", str(out), "--facts-per-question", "0"]) == 2
    err = capsys.readouterr().err
    assert ("--hops is for --task multihop only; --learnable is for --task toy and multihop only" in err
            and "--num-questions is for --task longform only" in err
            and "facts_per_question must be at least 1, got 0" in err)
