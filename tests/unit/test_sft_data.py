"""SFT data: demonstrations of the toy task, chat rows tokenised as the agent loop tokenises a rollout."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlsearch.data import DatasetError, make_toy_data
from rlsearch.data.chat import load_chat_dataset
from rlsearch.data.demos import FLAW_KINDS, bm25_search, write_demonstrations
from rlsearch.data.tiny_model import build_qwen2_tokenizer
from rlsearch.tools.protocol import SearchR1Protocol


@pytest.fixture(scope="module")
def tokenizer():
    return build_qwen2_tokenizer()


@pytest.fixture(scope="module")
def learnable_toy(tmp_path_factory):
    return make_toy_data(tmp_path_factory.mktemp("learnable"), seed=3, num_entities=80, learnable=True)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_learnable_toy_names_are_single_tokens_and_no_years(learnable_toy, tokenizer) -> None:
    rows = _rows(learnable_toy.train) + _rows(learnable_toy.test)
    for row in rows:
        entity, answer = row["metadata"]["entity"], row["golden_answers"][-1]
        assert len(tokenizer.encode(" " + entity)) == 1, entity
        assert len(tokenizer.encode(" " + answer)) == 1, answer
        assert not re.search(r"\d", answer)
        assert entity in row["question"]


def test_demonstrations_search_read_and_answer(learnable_toy, tmp_path: Path) -> None:
    search = bm25_search(learnable_toy.corpus)
    stats = write_demonstrations(learnable_toy.train, tmp_path / "sft.jsonl", search, topk=2, flawed_fraction=0.0)
    rows, qa = _rows(stats.path), _rows(learnable_toy.train)
    assert stats.rows == len(rows) == len(qa) and stats.flawed == 0
    protocol = SearchR1Protocol()
    corpus = {str(row["id"]): row["contents"] for row in _rows(learnable_toy.corpus)}
    for row, question in zip(rows, qa):
        user, call, tool, answer = row["messages"]
        entity = question["metadata"]["entity"]
        assert [m["role"] for m in row["messages"]] == ["user", "assistant", "tool", "assistant"]
        assert user["content"] == protocol.instruction(question["question"])
        assert call["content"] == f"<search> {entity} </search>"
        # the observation is the protocol's rendering of the retriever's top 2, and holds the answer's passage
        assert tool["content"].startswith("\n\n<information>Doc 1(Title: ") and tool["content"].endswith(
            "</information>\n\n")
        assert corpus[question["metadata"]["passage_id"]].split("\n", 1)[1] in tool["content"]
        assert answer["content"] == f"<answer> {question['golden_answers'][0]} </answer>"
        assert protocol.parse_turn(answer["content"]).answer == question["golden_answers"][0]


def test_flawed_demonstrations_are_counted_and_wrong(learnable_toy, tmp_path: Path) -> None:
    search = bm25_search(learnable_toy.corpus)
    stats = write_demonstrations(learnable_toy.train, tmp_path / "sft.jsonl", search, topk=1, flawed_fraction=0.25,
                                 seed=5)
    rows = _rows(stats.path)
    flawed = [row for row in rows if row["flawed"]]
    assert stats.flawed == len(flawed) == round(len(rows) * 0.25)
    assert {row["flawed"] for row in flawed} == set(FLAW_KINDS)
    for row, question in zip(rows, _rows(learnable_toy.train)):
        final = row["messages"][-1]["content"]
        if row["flawed"] == "guess":
            assert len(row["messages"]) == 2  # answered without searching
        if row["flawed"]:
            assert final == f"<answer> {question['metadata']['entity']} </answer>"
            assert question["metadata"]["entity"] not in question["golden_answers"]
    again = write_demonstrations(learnable_toy.train, tmp_path / "again.jsonl", search, topk=1, flawed_fraction=0.25,
                                 seed=5)
    assert again.path.read_bytes() == stats.path.read_bytes()


def test_demonstrations_need_toy_rows(tmp_path: Path) -> None:
    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"id": "q1", "question": "Who?", "golden_answers": ["A"]}) + "\n")
    with pytest.raises(ValueError, match="metadata.entity"):
        write_demonstrations(qa, tmp_path / "sft.jsonl", lambda queries, topk: [[] for _ in queries], topk=1)


def test_chat_rows_tokenise_like_a_rollout(tokenizer, tmp_path: Path) -> None:
    protocol = SearchR1Protocol()
    observation = protocol.observation([])
    messages = [
        {"role": "user", "content": protocol.instruction("Who is the mayor of Brook?")},
        {"role": "assistant", "content": "<search> Brook </search>"},
        {"role": "tool", "content": observation},
        {"role": "assistant", "content": "<answer> Harper </answer>"},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"id": "d1", "messages": messages}) + "\n")
    (example,) = load_chat_dataset(path, tokenizer, max_tokens=1024)
    # the prompt is what AgentLoop.prompt_ids builds; each later message is tokenised on its own and appended
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    parts = [tokenizer.encode(m["content"], add_special_tokens=False) for m in messages[1:]]
    assert example.id == "d1"
    assert example.token_ids == prompt + parts[0] + parts[1] + parts[2]
    assert example.response_start == len(prompt)
    assert example.loss_mask == [1] * len(parts[0]) + [0] * len(parts[1]) + [1] * len(parts[2])


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ('{"messages": [{"role": "assistant", "content": "hi"}]}', "must start with the prompt"),
        ('{"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "t"}]}',
         "must end with a non-empty 'assistant'"),
        ('{"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]}', "has role 'bot'"),
        ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, '
         '{"role": "user", "content": "q2"}, {"role": "assistant", "content": "b"}]}', "only 'assistant' and 'tool'"),
        ('{"messages": [{"role": "user", "content": 3}]}', "string 'content'"),
        ('{"text": "q"}', "'messages' list"),
        ("not json", "invalid JSON"),
    ],
)
def test_malformed_chat_rows_name_file_and_line(tokenizer, tmp_path: Path, row: str, message: str) -> None:
    good = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    path = tmp_path / "chat.jsonl"
    path.write_text(good + "\n" + row + "\n")
    with pytest.raises(DatasetError, match=re.escape(f"{path}:2: ") + ".*" + re.escape(message)):
        load_chat_dataset(path, tokenizer, max_tokens=1024)


def test_chat_rows_over_the_token_limit_and_empty_files(tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "word " * 50},
                                             {"role": "assistant", "content": "a"}]}) + "\n")
    with pytest.raises(DatasetError, match=re.escape(f"{path}:1: ") + r"\d+ tokens, more than the limit of 20"):
        load_chat_dataset(path, tokenizer, max_tokens=20)
    path.write_text("\n")
    with pytest.raises(DatasetError, match="contains no rows"):
        load_chat_dataset(path, tokenizer, max_tokens=20)


def test_learnable_toy_data_says_when_single_token_names_run_out(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="single-token vocabulary ran out of names"):
        make_toy_data(tmp_path, seed=0, num_entities=2000, learnable=True)
