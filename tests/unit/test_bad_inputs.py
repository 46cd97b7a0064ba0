"""Bad inputs stop with a clear error at load time, or are truncated: never a crash in the middle of a run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlsearch.data import DatasetError, load_qa_dataset
from rlsearch.data.dataset import MAX_QUESTION_CHARS
from rlsearch.rollout.observation import TRUNCATION_MARK, UNCAPPED_MAX_CHARS, fitted_observation
from rlsearch.tools import CallToolProtocol, Document, SearchR1Protocol

GOOD = {"question": "Who founded Velmora?", "golden_answers": ["Ada"]}


def _jsonl(path: Path, rows: list) -> Path:
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows))
    return path


@pytest.mark.parametrize("content", [b"", b"\n   \n\r\n\t\n"], ids=["empty", "blank-lines"])
def test_empty_dataset_names_the_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "train.jsonl"
    path.write_bytes(content)
    with pytest.raises(DatasetError) as error:
        load_qa_dataset(path)
    assert str(error.value) == f"{path} contains no rows (the file is empty or has only blank lines)"


def test_row_without_golden_answers_names_file_line_and_keys(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "train.jsonl", [GOOD, GOOD, {"question": "Where is Velmora?", "id": "q3"}])
    with pytest.raises(DatasetError) as error:
        load_qa_dataset(path)
    assert str(error.value).startswith(f"{path}:3: missing golden answers")
    assert "'golden_answers'" in str(error.value) and "'reward_model.ground_truth.target'" in str(error.value)


def test_non_utf8_bytes_name_file_and_line(tmp_path: Path) -> None:
    latin1 = '{"question": "Who founded Caf\xe9 Velmora?", "golden_answers": ["Ada"]}'.encode("latin-1")
    path = _jsonl(tmp_path / "train.jsonl", [GOOD, b"", latin1, GOOD])
    with pytest.raises(DatasetError) as error:  # a DatasetError, not a UnicodeDecodeError traceback
        load_qa_dataset(path)
    assert str(error.value).startswith(f"{path}:3: not valid UTF-8 (byte 0xe9 at byte offset 29 of the line)")
    assert error.value.__cause__ is None and error.value.__suppress_context__


def test_utf8_text_and_a_byte_order_mark_load(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    rows = [{"question": "谁创立了北京🚀?", "golden_answers": ["Café"]}, GOOD]
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(r, ensure_ascii=False) for r in rows).encode())
    examples = load_qa_dataset(path)
    assert [e.question for e in examples] == ["谁创立了北京🚀?", GOOD["question"]]
    assert examples[0].golden_answers == ("Café",)


def test_megabyte_question_is_an_error_naming_the_row_and_the_limit(tmp_path: Path) -> None:
    at_limit = {"question": "q" * MAX_QUESTION_CHARS, "golden_answers": ["a"]}
    huge = {"question": "x" * 1_000_000, "golden_answers": ["a"]}
    assert len(load_qa_dataset(_jsonl(tmp_path / "ok.jsonl", [at_limit]))[0].question) == MAX_QUESTION_CHARS
    path = _jsonl(tmp_path / "train.jsonl", [GOOD, huge])
    with pytest.raises(DatasetError, match=re.escape(
        f"{path}:2: the question has 1,000,000 characters, more than the limit of 32,768 "
        "(rlsearch.data.dataset.MAX_QUESTION_CHARS)"
    )):
        load_qa_dataset(path)
    with pytest.raises(DatasetError, match="the question has 32,769 characters, more than the limit of 32,768"):
        load_qa_dataset(_jsonl(tmp_path / "over.jsonl", [{**at_limit, "question": "q" * (MAX_QUESTION_CHARS + 1)}]))


def test_megabyte_question_in_parquet_names_the_row(tmp_path: Path) -> None:
    import pyarrow
    import pyarrow.parquet

    path = tmp_path / "train.parquet"
    rows = [GOOD, {"question": "y" * 1_000_000, "golden_answers": ["a"]}]
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    with pytest.raises(DatasetError, match=re.escape(f"{path}: row 2: the question has 1,000,000 characters")):
        load_qa_dataset(path)


CLOSING = {"search_r1": "</information>\n\n", "call_tool": "</snippet>\n</tool_output>\n"}
TEN_MB = "Velmora was founded by Ada Lovecraft in 1820. " * 218_000  # 10.0 MB, about 2.2M tokens


@pytest.mark.parametrize("protocol", [SearchR1Protocol(), CallToolProtocol()], ids=["search_r1", "call_tool"])
def test_ten_megabyte_tool_output_is_cut_to_the_budget(protocol, tokenizer) -> None:
    assert len(TEN_MB) > 10_000_000
    documents = [Document(text=TEN_MB, title="Velmora", id="d1"), Document(text="second hit", title="Two", id="d2")]
    budget = 96
    cut = fitted_observation(protocol, documents, budget, tokenizer).text
    assert budget - 5 <= len(tokenizer.encode(cut, add_special_tokens=False)) <= budget
    assert cut.endswith(CLOSING[protocol.name]) and TRUNCATION_MARK in cut and "Velmora was founded" in cut
    # the cut by characters before tokenising changes nothing: the same as the token cut of a 20k-character output
    normal = [Document(text=TEN_MB[:20_000], title="Velmora", id="d1"), documents[1]]
    assert fitted_observation(protocol, normal, budget, tokenizer).text == cut


@pytest.mark.parametrize("protocol", [SearchR1Protocol(), CallToolProtocol()], ids=["search_r1", "call_tool"])
def test_ten_megabyte_tool_output_without_a_budget_is_cut_by_characters(protocol, tokenizer) -> None:
    documents = [Document(text=TEN_MB, title="Velmora", id="d1"), Document(text="second hit", title="Two", id="d2")]
    cut = fitted_observation(protocol, documents, 0, tokenizer).text
    assert UNCAPPED_MAX_CHARS < len(cut) < UNCAPPED_MAX_CHARS + 200
    assert cut.endswith(CLOSING[protocol.name]) and TEN_MB[:UNCAPPED_MAX_CHARS] + TRUNCATION_MARK in cut
    assert "second hit" not in cut and "Two" in cut  # the later item keeps its tags, its text is over the limit
    # an output within the limit is rendered whole, as before
    small = [Document(text="word " * 300, title="Doc", id="1")]
    assert fitted_observation(protocol, small, 0, tokenizer) == (protocol.observation(small), False)
    assert fitted_observation(protocol, documents, 0, tokenizer).cut  # the character cut counts as a cut too


def test_a_user_agent_that_cannot_be_loaded_says_what_to_fix():
    from rlsearch.rollout.session import load_agent

    with pytest.raises(ValueError, match=r"cannot import 'no_such_package\.agents'.*importable from the directory"):
        load_agent("no_such_package.agents:agent")
    with pytest.raises(ValueError, match=r"has no `async def prompt_messages\(session, example\)`"):
        load_agent("rlsearch.rollout.agent_loop:prompt_messages")
    with pytest.raises(ValueError, match=r"has no `async def render\(session, example\)`"):
        load_agent("examples.agents.multi_tool:render")  # a plain function, not a coroutine function
    assert load_agent("examples.agents.search_r1:agent").__name__ == "agent"
