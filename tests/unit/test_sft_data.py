"""SFT data: demonstrations of the toy task, chat rows tokenised as the agent loop tokenises a rollout."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlsearch.data import DatasetError, make_toy_data
from rlsearch.data import toy as toy_module
from rlsearch.data.chat import load_chat_dataset
from rlsearch.data.demos import FLAW_KINDS, bm25_search, write_demonstrations, write_toy_demonstrations
from rlsearch.data.toy import answer_names, learnable_names
from rlsearch.tools.protocols import SearchR1Protocol
from tests.jsonl import read_jsonl


@pytest.fixture(scope="module")
def learnable_toy(tmp_path_factory):
    return make_toy_data(tmp_path_factory.mktemp("learnable"), seed=3, num_entities=80, learnable=True)


def test_learnable_toy_names_are_single_tokens_and_no_years(learnable_toy, tokenizer) -> None:
    rows = read_jsonl(learnable_toy.train) + read_jsonl(learnable_toy.test)
    for row in rows:
        entity, answer = row["metadata"]["entity"], row["golden_answers"][-1]
        assert len(tokenizer.encode(" " + entity)) == 1, entity
        assert len(tokenizer.encode(" " + answer)) == 1, answer
        assert not re.search(r"\d", answer)
        assert entity in row["question"]


def test_demonstrations_search_read_and_answer(learnable_toy, tmp_path: Path) -> None:
    search = bm25_search(learnable_toy.corpus)
    stats = write_demonstrations(learnable_toy.train, tmp_path / "sft.jsonl", search, topk=2, flawed_fraction=0.0)
    rows, qa = read_jsonl(stats.path), read_jsonl(learnable_toy.train)
    assert stats.rows == len(rows) == len(qa) and stats.flawed == 0
    protocol = SearchR1Protocol()
    corpus = {str(row["id"]): row["contents"] for row in read_jsonl(learnable_toy.corpus)}
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
    rows = read_jsonl(stats.path)
    flawed = [row for row in rows if row["flawed"]]
    assert stats.flawed == len(flawed) == round(len(rows) * 0.25)
    assert {row["flawed"] for row in flawed} == set(FLAW_KINDS)
    for row, question in zip(rows, read_jsonl(learnable_toy.train)):
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
    with pytest.raises(ValueError, match=r"the 9,\d{3} single-token names ran out"):
        make_toy_data(tmp_path, seed=0, num_entities=2000, learnable=True)
    with pytest.raises(ValueError, match=r"the 30 single-token names ran out .* or raise name_pool"):
        make_toy_data(tmp_path, seed=0, num_entities=11, learnable=True, name_pool=30, distractors_per_entity=0)
    with pytest.raises(ValueError, match="name_pool applies to the learnable variant only"):
        make_toy_data(tmp_path, seed=0, name_pool=30)


def test_learnable_names_stay_the_same() -> None:
    # toy.py's own words are template words and never names: a new word in its source (a comment too) that is also
    # a single-token name shrinks this set and changes every learnable corpus made with the same seed
    names = learnable_names()
    assert len(names) == 9007, "a word added to rlsearch/data/toy.py removed single-token names: reword it"
    assert learnable_names(5) == ["Bols", "Defender", "Interest", "Quarry", "Tesla"]
    assert answer_names(3) == ["Base", "Preferred", "Roch"]


def _names(toy) -> set[str]:
    """Every capitalised word of the corpus that is no template word: the names it invents."""
    template = {word.lower() for word in re.findall(r"[A-Za-z]+", Path(toy_module.__file__).read_text())}
    words = set(re.findall(r"[A-Z][a-z]+", toy.corpus.read_text()))
    return {word for word in words if word.lower() not in template}


def test_name_pool_is_shared_by_every_seed(tmp_path: Path) -> None:
    pool = set(learnable_names(30))
    assert len(pool) == 30 and pool == set(learnable_names(30)) and pool < set(learnable_names())
    toys = [make_toy_data(tmp_path / str(seed), seed=seed, num_entities=10, learnable=True, name_pool=30,
                          distractors_per_entity=0) for seed in (1, 2)]
    names = [_names(toy) for toy in toys]
    # 10 entities take all 30 names in both corpora, each giving them other facts
    assert names[0] == names[1] == pool
    assert toys[0].corpus.read_text() != toys[1].corpus.read_text()


def test_toy_demonstrations_pool_extra_corpora(tmp_path: Path) -> None:
    options = dict(num_entities=10, test_fraction=0.5, distractors_per_entity=0, learnable=True, name_pool=30)
    toy = make_toy_data(tmp_path / "toy", seed=4, **options)
    prompt = tmp_path / "short.yaml"
    prompt.write_text('system: ""\nuser: "Q: {question}\\n"\ntool_line: "- {name}"\n')
    stats = write_toy_demonstrations(toy, tmp_path / "sft.jsonl", topk=1, flawed_fraction=0.5, seed=4,
                                     extra_corpora=3, prompt_file=prompt, **options)
    rows = read_jsonl(stats.path)
    # round(5 * 0.5) = 2 flawed demonstrations per corpus
    assert stats.rows == len(rows) == 4 * 5 and stats.flawed == sum(row["flawed"] is not None for row in rows) == 4 * 2
    # the toy set's own demonstrations come first, then those of the 3 extra corpora (gone: only demos remain)
    assert [row["id"] for row in rows[:5]] == [row["id"] for row in read_jsonl(toy.train)]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["sft.jsonl", "short.yaml", "toy"]
    test_questions = {row["question"] for row in read_jsonl(toy.test)}
    assert all(row["messages"][0]["content"].startswith("Q: ") for row in rows)
    assert not test_questions & {row["messages"][0]["content"][3:-1] for row in rows}
    again = write_toy_demonstrations(toy, tmp_path / "again.jsonl", topk=1, flawed_fraction=0.5, seed=4,
                                     extra_corpora=3, prompt_file=prompt, **options)
    assert again.path.read_bytes() == stats.path.read_bytes()


def test_make_toy_data_command_writes_the_learnable_task(tmp_path: Path, capsys) -> None:
    from rlsearch.cli import main

    prompt = Path(__file__).resolve().parents[2] / "examples" / "prompts" / "search_r1_short.yaml"
    code = main(["make-toy-data", "--out", str(tmp_path), "--seed", "5", "--learnable", "--name-pool", "60",
                 "--num-entities", "20", "--distractors-per-entity", "0", "--test-fraction", "0.5",
                 "--demo-corpora", "2", "--demo-topk", "1", "--flawed-fraction", "0", "--prompt-file", str(prompt)])
    assert code == 0
    assert f"{tmp_path / 'sft.jsonl'} (30 rows, 0 flawed)" in capsys.readouterr().out
    train, test, demos = (read_jsonl(tmp_path / name) for name in ("train.jsonl", "test.jsonl", "sft.jsonl"))
    assert len(train) == len(test) == 10 and len(read_jsonl(tmp_path / "corpus.jsonl")) == 20
    instruction = SearchR1Protocol(prompt_file=prompt).instruction(train[0]["question"])
    assert demos[0]["messages"][0]["content"] == instruction and len(instruction) < 150
    assert {name for row in train + test for name in (row["metadata"]["entity"], row["golden_answers"][-1])} <= set(
        learnable_names(60))


def test_answer_pool_deals_every_answer_from_its_own_names(tmp_path: Path, capsys) -> None:
    from rlsearch.cli import main

    titles, answers = set(learnable_names(60)), set(answer_names(12))
    assert len(answers) == 12 and not titles & answers
    assert set(learnable_names(0, 12)) == set(learnable_names()) - answers
    code = main(["make-toy-data", "--out", str(tmp_path), "--seed", "1", "--learnable", "--name-pool", "60",
                 "--answer-pool", "12", "--num-entities", "40", "--distractors-per-entity", "0", "--test-fraction",
                 "0.5", "--demo-topk", "1"])
    assert code == 0 and "(20 rows, 10 flawed)" in capsys.readouterr().out
    rows = read_jsonl(tmp_path / "train.jsonl") + read_jsonl(tmp_path / "test.jsonl")
    corpus = {row["id"]: row["contents"] for row in read_jsonl(tmp_path / "corpus.jsonl")}
    entities = [row["metadata"]["entity"] for row in rows]
    assert len(set(entities)) == 40 and set(entities) <= titles
    for row in rows:
        answer = row["golden_answers"][-1]
        assert answer in answers and answer in corpus[row["metadata"]["passage_id"]]
    # 40 passages x 2 fact names, each of the 12 once per shuffle of the pool: every name 6 or 7 times, never a title
    text = "".join(corpus.values())
    counts = [len(re.findall(rf"\b{name}\b", text)) for name in sorted(answers)]
    assert sum(counts) == 80 and max(counts) - min(counts) <= 1
    assert "answers are drawn from a pool of 12 names" in (tmp_path / "README.txt").read_text()


def test_answer_pool_errors_name_the_option(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="answer_pool applies to the learnable variant only"):
        make_toy_data(tmp_path, seed=0, answer_pool=30)
    with pytest.raises(ValueError, match=r"name_pool \+ answer_pool must be at most 9,\d{3} .* got 9000 \+ 500"):
        make_toy_data(tmp_path, seed=0, learnable=True, name_pool=9000, answer_pool=500)
    with pytest.raises(ValueError, match=r"the 10 single-token names ran out \(each passage takes 3, 1 with an "
                       r"answer_pool\)"):
        make_toy_data(tmp_path, seed=0, num_entities=11, learnable=True, name_pool=10, answer_pool=5,
                      distractors_per_entity=0)
