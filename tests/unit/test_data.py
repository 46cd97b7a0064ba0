import json
import re
from pathlib import Path

import pytest

from rlsearch.data import DatasetError, QAExample, load_qa_dataset, make_toy_data
from tests.jsonl import read_jsonl


def write_jsonl_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow
    import pyarrow.parquet

    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    return path


# ---------------------------------------------------------------- loading


def test_load_jsonl_raw_rows(tmp_path: Path) -> None:
    path = write_jsonl_lines(
        tmp_path / "mini.jsonl",
        [
            json.dumps(
                {
                    "id": 7,
                    "question": "Who wrote Hamlet?",
                    "golden_answers": ["Shakespeare", "W. S."],
                    "data_source": "nq",
                }
            ),
            "",
            '{"question": "  Capital of France?  ", "golden_answers": "Paris"}',
        ],
    )
    assert load_qa_dataset(path, default_data_source="custom") == [
        QAExample(
            id="7", question="Who wrote Hamlet?", golden_answers=("Shakespeare", "W. S."), data_source="nq"
        ),
        QAExample(
            id="mini-1", question="Capital of France?", golden_answers=("Paris",), data_source="custom"
        ),
    ]


def test_load_jsonl_processed_rows(tmp_path: Path) -> None:
    rows = [
        {
            "id": "a",
            "data_source": "hotpotqa",
            "prompt": [{"role": "user", "content": "template around the question"}],
            "extra_info": {"split": "train", "index": 0, "question": "Where is Velmora?"},
            "reward_model": {"style": "rule", "ground_truth": {"target": ["Quandish", "the Quandish"]}},
        },
        {"question": "Year?", "reward_model": {"ground_truth": {"target": "1734"}}},
    ]
    path = write_jsonl_lines(tmp_path / "proc.jsonl", [json.dumps(row) for row in rows])
    assert load_qa_dataset(path) == [
        QAExample(
            id="a",
            question="Where is Velmora?",
            golden_answers=("Quandish", "the Quandish"),
            data_source="hotpotqa",
        ),
        QAExample(id="proc-1", question="Year?", golden_answers=("1734",), data_source="unknown"),
    ]


def test_load_parquet(tmp_path: Path) -> None:
    path = write_parquet(
        tmp_path / "mini.parquet",
        [
            {"id": 3, "question": "q one", "golden_answers": ["a", "b"], "data_source": "triviaqa"},
            {"id": None, "question": "q two", "golden_answers": ["c"], "data_source": None},
        ],
    )
    assert load_qa_dataset(path, default_data_source="dflt") == [
        QAExample(id="3", question="q one", golden_answers=("a", "b"), data_source="triviaqa"),
        QAExample(id="mini-1", question="q two", golden_answers=("c",), data_source="dflt"),
    ]


def test_load_parquet_processed_rows(tmp_path: Path) -> None:
    path = write_parquet(
        tmp_path / "proc.parquet",
        [{"question": "q", "reward_model": {"style": "rule", "ground_truth": {"target": ["x", "y"]}}}],
    )
    assert load_qa_dataset(path) == [
        QAExample(id="proc-0", question="q", golden_answers=("x", "y"), data_source="unknown")
    ]


def test_malformed_parquet_row_names_the_row(tmp_path: Path) -> None:
    path = write_parquet(
        tmp_path / "bad.parquet",
        [{"question": "q", "golden_answers": ["a"]}, {"question": "", "golden_answers": ["b"]}],
    )
    with pytest.raises(DatasetError, match=re.escape(f"{path}: row 2: missing or empty 'question'")):
        load_qa_dataset(path)


def test_unreadable_parquet(tmp_path: Path) -> None:
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"this is not parquet")
    with pytest.raises(DatasetError, match=re.escape(f"{path}: not a readable parquet file")):
        load_qa_dataset(path)


@pytest.mark.parametrize(
    ("bad_line", "expected_problem"),
    [
        ('{"question": "q", "golden_answers": ["a"]', "invalid JSON"),
        ('["q", "a"]', "expected a JSON object, got list"),
        ('{"question": ""}', "missing or empty 'question'"),
        ('{"question": "   ", "golden_answers": ["a"]}', "missing or empty 'question'"),
        ('{"golden_answers": ["a"]}', "missing or empty 'question'"),
        ('{"question": 5, "golden_answers": ["a"]}', "missing or empty 'question'"),
        ('{"question": "q"}', "missing golden answers"),
        ('{"question": "q", "reward_model": {"ground_truth": {}}}', "missing golden answers"),
        ('{"question": "q", "golden_answers": ["a", 1]}', "golden answers must be strings"),
        ('{"question": "q", "golden_answers": 1}', "golden answers must be a string or a list of strings"),
        ('{"question": "q", "golden_answers": []}', "empty list of golden answers"),
    ],
)
def test_malformed_jsonl_row_names_file_and_line(
    tmp_path: Path, bad_line: str, expected_problem: str
) -> None:
    good_line = '{"question": "q", "golden_answers": ["a"]}'
    path = write_jsonl_lines(tmp_path / "broken.jsonl", [good_line, "", bad_line, good_line])
    with pytest.raises(DatasetError) as error:
        load_qa_dataset(path)
    assert str(error.value).startswith(f"{path}:3: {expected_problem}")


@pytest.mark.parametrize("content", ["", "\n  \n\n"])
def test_empty_file(tmp_path: Path, content: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DatasetError, match=re.escape(f"{path} contains no rows")):
        load_qa_dataset(path)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.jsonl"
    with pytest.raises(DatasetError, match=re.escape(f"dataset file not found: {path}")):
        load_qa_dataset(path)


def test_unsupported_suffix(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_text("question,answer\n", encoding="utf-8")
    with pytest.raises(DatasetError) as error:
        load_qa_dataset(path)
    message = str(error.value)
    assert str(path) in message
    assert ".jsonl" in message
    assert ".parquet" in message


# ---------------------------------------------------------------- toy data


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("toy")
    make_toy_data(out, seed=0)
    return out


def contains_word(text: str, phrase: str) -> bool:
    return re.search(rf"\b{re.escape(phrase)}\b", text, flags=re.IGNORECASE) is not None


def test_toy_data_paths_and_sizes(tmp_path: Path) -> None:
    paths = make_toy_data(tmp_path / "nested" / "toy", seed=3, num_entities=50, test_fraction=0.3)
    assert paths.corpus == tmp_path / "nested" / "toy" / "corpus.jsonl"
    assert paths.train == tmp_path / "nested" / "toy" / "train.jsonl"
    assert paths.test == tmp_path / "nested" / "toy" / "test.jsonl"
    assert len(read_jsonl(paths.corpus)) == 50 * 3
    assert len(load_qa_dataset(paths.train)) == 35
    assert len(load_qa_dataset(paths.test)) == 15
    assert "corpus.jsonl" in (tmp_path / "nested" / "toy" / "README.txt").read_text(encoding="utf-8")


def test_toy_data_without_distractors(tmp_path: Path) -> None:
    paths = make_toy_data(tmp_path, seed=0, num_entities=5, test_fraction=0.2, distractors_per_entity=0)
    assert len(read_jsonl(paths.corpus)) == 5
    assert len(read_jsonl(paths.train)) == 4
    assert len(read_jsonl(paths.test)) == 1


def test_toy_data_is_deterministic(tmp_path: Path) -> None:
    file_names = ("corpus.jsonl", "train.jsonl", "test.jsonl", "README.txt")
    make_toy_data(tmp_path / "a", seed=0)
    make_toy_data(tmp_path / "b", seed=0)
    make_toy_data(tmp_path / "c", seed=1)
    for name in file_names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    for name in ("corpus.jsonl", "train.jsonl", "test.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() != (tmp_path / "c" / name).read_bytes()


def test_toy_rows_load_and_have_unique_ids(toy_dir: Path) -> None:
    train = load_qa_dataset(toy_dir / "train.jsonl")
    test = load_qa_dataset(toy_dir / "test.jsonl")
    assert (len(train), len(test)) == (160, 40)
    assert {example.data_source for example in train + test} == {"toy"}
    ids = [example.id for example in train + test]
    assert len(set(ids)) == 200
    assert not {example.question for example in train} & {example.question for example in test}
    passage_ids = [row["id"] for row in read_jsonl(toy_dir / "corpus.jsonl")]
    assert len(set(passage_ids)) == len(passage_ids) == 600


def test_toy_answers_appear_only_in_their_entity_passage(toy_dir: Path) -> None:
    corpus = {row["id"]: row["contents"] for row in read_jsonl(toy_dir / "corpus.jsonl")}
    qa_rows = read_jsonl(toy_dir / "train.jsonl") + read_jsonl(toy_dir / "test.jsonl")
    for row in qa_rows:
        passage_id = row["metadata"]["passage_id"]
        title = corpus[passage_id].split("\n")[0].strip('"')
        assert title in row["question"]
        for answer in row["golden_answers"]:
            assert 1 <= len(answer.split()) <= 3
            assert answer in corpus[passage_id]
            holders = [pid for pid, contents in corpus.items() if contains_word(contents, answer)]
            assert holders == [passage_id], (row, answer)


def test_toy_distractors_mention_the_question_entity(toy_dir: Path) -> None:
    corpus = {row["id"]: row["contents"] for row in read_jsonl(toy_dir / "corpus.jsonl")}
    for row in read_jsonl(toy_dir / "test.jsonl"):
        title = corpus[row["metadata"]["passage_id"]].split("\n")[0].strip('"')
        mentioning = [pid for pid, contents in corpus.items() if contains_word(contents, title)]
        assert len(mentioning) == 3


@pytest.mark.parametrize(
    "arguments",
    [
        {"num_entities": 1},
        {"test_fraction": 0.0},
        {"test_fraction": 1.0},
        {"distractors_per_entity": -1},
        {"num_entities": 3001, "distractors_per_entity": 2},
    ],
)
def test_toy_data_rejects_bad_arguments(tmp_path: Path, arguments: dict) -> None:
    with pytest.raises(ValueError, match="|".join(arguments)):
        make_toy_data(tmp_path, **arguments)
    assert not (tmp_path / "corpus.jsonl").exists()
