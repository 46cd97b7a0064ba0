"""The multihop task: chains of k lookups answerable with exactly k searches of the real BM25 index, its
demonstrations in both tag formats, its CLI, and the eval breakdown by hop count."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlsearch.data import QAExample, load_qa_dataset, make_multihop_data
from rlsearch.data.demos import FLAW_KINDS, bm25_search, write_demonstrations
from rlsearch.data.multihop import parse_hops, reserved_words
from rlsearch.data.tiny_model import build_qwen2_tokenizer
from rlsearch.eval import EvalQuestion, EvalSummary, render_hops_table, summarize_by_hops
from rlsearch.eval.runner import EvalRun
from rlsearch.reward import get_scorer
from rlsearch.reward.registry import scorer_name_for
from rlsearch.rollout import Trajectory
from rlsearch.rollout.observation import fitted_observation
from rlsearch.tools import Document, SearchTool, TurnKind, make_protocol
from rlsearch.tools.protocols.folding import FOLD_INSTRUCTION, FOLDED_QUESTION, SUMMARY_CLOSE, summary_text
from rlsearch.tools.servers.retrieval import BM25Retriever
from tests.jsonl import read_jsonl

TOPK = 3
# learnable: single-token names, hops 2-4, 1 distractor each; invented names: the longest chains, padded passages
DATASETS = {
    "learnable": dict(seed=7, hops=(2, 3, 4), num_chains=30, learnable=True),
    "padded": dict(seed=1, hops=(2, 7, 16), num_chains=9, distractors_per_entity=2, passage_words=150),
}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    return {name: make_multihop_data(tmp_path_factory.mktemp(name), **options) for name, options in DATASETS.items()}


def _names(text: str) -> list[str]:
    """The words of ``text`` that are names (no template word, no stopword), in order."""
    return [word for word in re.findall(r"[A-Za-z]+", text) if word.lower() not in reserved_words()]


def _em(answer: str, golden: list[str]) -> float:
    scorer = get_scorer(scorer_name_for("multihop", "", {}))  # the scorer eval and training give the source
    return scorer(f"<answer> {answer} </answer>", golden, 0.0).em


def _agent(question: str, retriever: BM25Retriever, searches: int) -> SimpleNamespace:
    """Reads nothing but the question and search results: searches the entity the question names, then each time
    the one name the top passage holds besides its title; answers with the name it read last."""
    (query,) = _names(question)
    visited, observations = [], []
    for _ in range(searches):
        (hits,) = retriever.search([query], TOPK)
        documents = [Document.from_passage(document["contents"], str(document["id"])) for document, _ in hits]
        observations.append(" ".join(document.text for document in documents))
        top = documents[0]
        assert top.title == f'"{query}"', f"searching {query} ranked {top.title} first"
        visited.append((query, top.id))
        (query,) = set(_names(top.text)) - {query}  # the passage names one entity besides its title
    return SimpleNamespace(answer=query, visited=visited, observations=observations)


@pytest.mark.parametrize("name", DATASETS)
def test_every_question_takes_exactly_k_searches(datasets, name: str) -> None:
    data = datasets[name]
    retriever = BM25Retriever.from_corpus(data.corpus)  # the index class of the local retrieval server
    rows = read_jsonl(data.train) + read_jsonl(data.test)
    assert len(rows) == DATASETS[name]["num_chains"]
    for row in rows:
        hops, golden = row["metadata"]["hops"], row["golden_answers"]
        assert row["question"].count(" of ") == hops
        oracle = _agent(row["question"], retriever, searches=hops)
        assert _em(oracle.answer, golden) == 1.0, row["id"]
        assert oracle.visited == list(zip(row["metadata"]["chain"], row["metadata"]["passage_ids"]))
        early = _agent(row["question"], retriever, searches=hops - 1)
        assert _em(early.answer, golden) == 0.0, row["id"]
        assert early.answer == row["metadata"]["chain"][-1]
        # no observation before the k-th search shows the answer, not even below the top passage
        answer = re.compile(rf"\b{golden[0]}\b", re.IGNORECASE)
        assert not any(answer.search(text) for text in oracle.observations[:-1]), row["id"]
        assert answer.search(oracle.observations[-1])


@pytest.mark.parametrize("name", DATASETS)
def test_answers_are_only_in_the_last_passage_and_passages_name_only_the_next(datasets, name: str) -> None:
    data = datasets[name]
    corpus = {row["id"]: row["contents"] for row in read_jsonl(data.corpus)}
    titles = [contents.split("\n", 1)[0] for contents in corpus.values()]
    assert len(set(titles)) == len(titles)
    for row in read_jsonl(data.train) + read_jsonl(data.test):
        answer, chain, ids = row["golden_answers"][0], row["metadata"]["chain"], row["metadata"]["passage_ids"]
        holding = [pid for pid, contents in corpus.items() if re.search(rf"\b{answer}\b", contents, re.IGNORECASE)]
        assert holding == [ids[-1]], row["id"]
        assert answer not in row["question"] and _names(row["question"]) == [chain[0]]
        for position, (entity, pid) in enumerate(zip(chain, ids)):
            following = chain[position + 1] if position + 1 < len(chain) else answer
            assert set(_names(corpus[pid])) == {entity, following}, corpus[pid]


def test_rows_split_every_hop_count_and_pad_passages(datasets) -> None:
    learnable, padded = datasets["learnable"], datasets["padded"]
    test_hops = Counter(row["metadata"]["hops"] for row in read_jsonl(learnable.test))
    train_hops = Counter(row["metadata"]["hops"] for row in read_jsonl(learnable.train))
    assert test_hops == {2: 2, 3: 2, 4: 2} and train_hops == {2: 8, 3: 8, 4: 8}  # 10 chains a hop count, 20% test
    rows = read_jsonl(padded.train) + read_jsonl(padded.test)
    assert Counter(row["metadata"]["hops"] for row in rows) == {2: 3, 7: 3, 16: 3}
    assert {row["data_source"] for row in rows} == {"multihop"}
    assert all(len(row["metadata"]["chain"]) == len(row["metadata"]["passage_ids"]) == row["metadata"]["hops"]
               for row in rows)
    # 3 chains x (2 + 7 + 16 entities) x (1 + 2 distractors); every text holds >= 150 filler words + its 2 sentences
    passages = read_jsonl(padded.corpus)
    assert len(passages) == 25 * 3 * 3
    assert min(len(row["contents"].split("\n", 1)[1].split()) for row in passages) >= 150 + 8
    assert max(len(row["contents"].split()) for row in read_jsonl(learnable.corpus)) < 20


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    options = dict(hops=(2, 5), num_chains=6, passage_words=20, learnable=True)
    first, again = make_multihop_data(tmp_path / "a", seed=3, **options), make_multihop_data(tmp_path / "b", seed=3,
                                                                                             **options)
    other = make_multihop_data(tmp_path / "c", seed=4, **options)
    for file in ("corpus.jsonl", "train.jsonl", "test.jsonl", "README.txt"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes(), file
    assert first.corpus.read_bytes() != other.corpus.read_bytes() and again.train.read_bytes() != \
        other.train.read_bytes()


def test_learnable_names_are_single_tokens(datasets) -> None:
    tokenizer = build_qwen2_tokenizer()
    rows = read_jsonl(datasets["learnable"].train) + read_jsonl(datasets["learnable"].test)
    names = [name for row in rows for name in (*row["metadata"]["chain"], row["golden_answers"][0])]
    assert len(names) == len(set(names)) == 10 * (3 + 4 + 5)
    assert all(len(tokenizer.encode(" " + name)) == 1 for name in names)


@pytest.mark.parametrize("protocol_name", ["search_r1", "call_tool"])
def test_demonstrations_search_each_entity_and_render_like_the_rollout(datasets, tmp_path: Path,
                                                                       protocol_name: str) -> None:
    data = datasets["learnable"]
    search = bm25_search(data.corpus)
    stats = write_demonstrations(data.train, tmp_path / "sft.jsonl", search, topk=2, protocol_name=protocol_name)
    protocol = make_protocol(protocol_name, [SearchTool(None).spec])
    tokenizer = build_qwen2_tokenizer()
    # the rollout's path from a call to its observation: the search tool's documents, fitted with no token budget
    tool = SearchTool(SimpleNamespace(topk=2, search=search))
    demos, questions = read_jsonl(stats.path), read_jsonl(data.train)
    assert stats.rows == len(demos) == len(questions) == 24 and stats.flawed == 0
    for demo, question in zip(demos, questions):
        chain, messages = question["metadata"]["chain"], demo["messages"]
        prompt = [m["content"] for m in messages if m["role"] in ("system", "user")]
        assert prompt == [p for p in (protocol.system_prompt(), protocol.instruction(question["question"])) if p]
        calls = [m for m in messages if m["role"] == "assistant"]
        observations = [m["content"] for m in messages if m["role"] == "tool"]
        assert len(calls) == len(chain) + 1 and len(observations) == len(chain)
        for call, entity, observation in zip(calls, chain, observations):
            parsed = protocol.parse_turn(call["content"])
            assert parsed.kind == TurnKind.TOOL_CALL and (parsed.call.name, parsed.call.query) == ("search", entity)
            (result,) = tool.run_batch([parsed.call])
            assert observation == fitted_observation(protocol, result.documents, 0, tokenizer).text
        final = protocol.parse_turn(calls[-1]["content"])
        assert final.kind == TurnKind.ANSWER and _em(final.answer, question["golden_answers"]) == 1.0
    if protocol_name == "call_tool":
        system, user, call, tool_output = demos[0]["messages"][:4]
        assert system["role"] == "system" and "- search: " in system["content"]
        assert tool_output["content"].startswith("\n<tool_output>\n<snippet id=")


def test_flawed_demonstrations_answer_wrong(datasets, tmp_path: Path) -> None:
    data = datasets["learnable"]
    stats = write_demonstrations(data.train, tmp_path / "sft.jsonl", bm25_search(data.corpus), topk=1,
                                 flawed_fraction=0.5, seed=2)
    demos, questions = read_jsonl(stats.path), read_jsonl(data.train)
    assert stats.flawed == sum(demo["flawed"] is not None for demo in demos) == 12
    assert {demo["flawed"] for demo in demos} == {None, *FLAW_KINDS}
    for demo, question in zip(demos, questions):
        searches = [m for m in demo["messages"] if m["role"] == "tool"]
        final = demo["messages"][-1]["content"]
        expected = {None: (question["metadata"]["hops"], question["golden_answers"][0]), "guess": (0, question[
            "metadata"]["chain"][0]), "misread": (question["metadata"]["hops"], question["metadata"]["chain"][-1])}
        assert (len(searches), final) == (expected[demo["flawed"]][0], f"<answer> {expected[demo['flawed']][1]} "
                                          "</answer>")
        assert _em(expected[demo["flawed"]][1], question["golden_answers"]) == float(demo["flawed"] is None)


def test_folding_demonstrations_fold_as_the_agent_loop_does(datasets, tmp_path: Path) -> None:
    data = datasets["learnable"]
    search = bm25_search(data.corpus)
    plain = write_demonstrations(data.train, tmp_path / "plain.jsonl", search, topk=2, flawed_fraction=0.5, seed=3)
    stats = write_demonstrations(data.train, tmp_path / "sft.jsonl", search, topk=2, flawed_fraction=0.5, seed=3,
                                 fold_fraction=0.5)
    protocol = make_protocol("search_r1", [SearchTool(None).spec])
    rows, questions = read_jsonl(stats.path), {row["id"]: row for row in read_jsonl(data.train)}
    by_question: dict[str, list[dict]] = {}
    for row in rows:
        by_question.setdefault(row["id"].split("-segment-")[0], []).append(row)
    folding = {key: segments for key, segments in by_question.items() if len(segments) > 1 or "-segment-" in
               segments[0]["id"]}
    # the flawed demonstrations are the plain run's (the fold choice has its own random stream); 6 of 12 good ones fold
    assert [row for row in rows if row["flawed"]] == [row for row in read_jsonl(plain.path) if row["flawed"]]
    assert (stats.folded, len(folding), stats.flawed) == (6, 6, 12)
    assert stats.rows == len(rows) == 24 + sum(len(segments) - 1 for segments in folding.values())
    notice = protocol.wrap(FOLD_INSTRUCTION)
    for key, segments in folding.items():
        question = questions[key]
        chain, summary = question["metadata"]["chain"], None
        searched = []
        assert segments[0]["flawed"] is None
        for number, segment in enumerate(segments):
            messages = segment["messages"]
            asked = question["question"] if summary is None else FOLDED_QUESTION.format(
                question=question["question"], summary=summary)
            assert messages[0] == {"role": "user", "content": protocol.instruction(asked)}
            turns = [protocol.parse_turn(m["content"]) for m in messages if m["role"] == "assistant"]
            searched += [turn.call.query for turn in turns if turn.kind == TurnKind.TOOL_CALL]
            if number < len(segments) - 1:  # folded: the loop's notice, then a summary of the chain's facts so far
                assert messages[-2] == {"role": "tool", "content": notice}
                assert messages[-1]["content"].endswith(SUMMARY_CLOSE)
                summary = summary_text(messages[-1]["content"])
                facts = re.findall(r"The [a-z]+ of (\w+) is (\w+)\.", summary)
                assert facts == list(zip(chain, [*chain[1:], question["golden_answers"][0]]))[:len(searched)]
            else:
                assert turns[-1].kind == TurnKind.ANSWER and turns[-1].answer == question["golden_answers"][0]
        assert searched == chain


def test_fold_fraction_out_of_range_is_refused(datasets, tmp_path: Path, capsys) -> None:
    from rlsearch.cli import main

    with pytest.raises(ValueError, match=r"fold_fraction must be within \[0, 1\], got 1.5"):
        write_demonstrations(datasets["learnable"].train, tmp_path / "sft.jsonl",
                             bm25_search(datasets["learnable"].corpus), topk=1, fold_fraction=1.5)
    assert main(["make-toy-data", "--out", str(tmp_path / "toy"), "--fold-fraction", "0.5"]) == 2
    assert "--fold-fraction is for --task multihop only" in capsys.readouterr().err


def test_make_toy_data_command_writes_the_multihop_task(tmp_path: Path, capsys) -> None:
    from rlsearch.cli import main

    code = main(["make-toy-data", "--task", "multihop", "--out", str(tmp_path), "--hops", "3,2", "--num-chains",
                 "8", "--passage-words", "30", "--learnable", "--demo-topk", "1", "--flawed-fraction", "0",
                 "--protocol", "call_tool"])
    assert code == 0 and f"{tmp_path / 'sft.jsonl'} (6 rows, 0 flawed)" in capsys.readouterr().out
    rows = read_jsonl(tmp_path / "train.jsonl") + read_jsonl(tmp_path / "test.jsonl")
    assert Counter(row["metadata"]["hops"] for row in rows) == {2: 4, 3: 4}
    demos = {demo["id"]: demo for demo in read_jsonl(tmp_path / "sft.jsonl")}
    for row in read_jsonl(tmp_path / "train.jsonl"):
        calls = [m["content"] for m in demos[row["id"]]["messages"] if m["role"] == "assistant"][:-1]
        assert calls == [f'<call_tool name="search">{entity}</call_tool>' for entity in row["metadata"]["chain"]]
    assert "k in 2, 3" in (tmp_path / "README.txt").read_text()
    examples = load_qa_dataset(tmp_path / "test.jsonl")
    assert sorted(example.hops for example in examples) == [2, 3]
    assert main(["make-toy-data", "--out", str(tmp_path / "toy"), "--passage-words", "9"]) == 2
    assert main(["make-toy-data", "--task", "multihop", "--out", str(tmp_path / "m"), "--name-pool", "9"]) == 2
    assert main(["make-toy-data", "--task", "multihop", "--out", str(tmp_path / "m"), "--hops", "2,17"]) == 2
    err = capsys.readouterr().err
    assert "--passage-words is for --task multihop only" in err and "--name-pool is for --task toy only" in err
    assert "hops must be one or more counts from 2 to 16, got [2, 17]" in err


def test_bad_arguments_name_the_option(tmp_path: Path) -> None:
    assert parse_hops("2, 4,8") == (2, 4, 8)
    with pytest.raises(ValueError, match="whole numbers separated by commas"):
        parse_hops("2;3")
    with pytest.raises(ValueError, match=r"from 2 to 16, got \[1, 3\]"):
        make_multihop_data(tmp_path, hops=(3, 1))
    with pytest.raises(ValueError, match="num_chains must be at least 6"):
        make_multihop_data(tmp_path, hops=(2, 3, 4), num_chains=5)
    with pytest.raises(ValueError, match=r"take 99,000 names, more than the 8,\d{3} single-token names"):
        make_multihop_data(tmp_path, hops=(16,), num_chains=3000, distractors_per_entity=1, learnable=True)


def _record(hops: int | None, example_id: str, em: float, f1: float, searches: int, source: str = "multihop") -> dict:
    turns = [{"kind": "tool_call", "tool_calls": [{"name": "search"}]} for _ in range(searches)]
    turns.append({"kind": "tool_call", "tool_calls": [{"name": "browse"}]})  # not a search
    record = {"eval_file": "test.jsonl", "data_source": source, "example_id": example_id, "turns": turns,
              "scores": {"em": em, "f1": f1}}
    return record if hops is None else {**record, "hops": hops}


def test_eval_breakdown_by_hops_returns_the_numbers_fed() -> None:
    records = [
        _record(2, "a", em=1.0, f1=1.0, searches=2), _record(2, "a", em=0.0, f1=0.5, searches=1),
        _record(2, "b", em=1.0, f1=1.0, searches=3),
        _record(10, "c", em=0.0, f1=0.25, searches=10),
        _record(None, "d", em=1.0, f1=1.0, searches=1, source="toy"),
    ]
    by_hops = summarize_by_hops(records)
    assert list(by_hops) == ["multihop"] and list(by_hops["multihop"]) == ["2", "10"]  # numeric order
    assert by_hops["multihop"]["2"] == pytest.approx(
        {"questions": 2.0, "samples": 3.0, "em": 2 / 3, "f1": 2.5 / 3, "searches": 2.0})
    assert by_hops["multihop"]["10"] == pytest.approx(
        {"questions": 1.0, "samples": 1.0, "em": 0.0, "f1": 0.25, "searches": 10.0})
    assert summarize_by_hops([records[-1]]) == {}
    table = render_hops_table(by_hops).splitlines()
    assert table[0].split() == ["data_source", "hops", "questions", "samples", "EM", "F1", "searches"]
    assert table[1].split() == ["multihop", "2", "2", "3", "0.667", "0.833", "2.00"]
    assert table[2].split() == ["multihop", "10", "1", "1", "0.000", "0.250", "10.00"]
    summary = EvalSummary(Path("/tmp/e"), "m", ["test.jsonl"], 1, 5, 0, 1.0, {}, by_hops)
    assert summary.to_json()["by_hops"] == by_hops and summary.scalars()["eval/multihop/hops_10/searches"] == 10.0
    assert render_hops_table(by_hops) in summary.render()
    assert "by_hops" not in EvalSummary(Path("/tmp/e"), "m", [], 1, 0, 0, 1.0).to_json()


def test_eval_records_carry_the_rows_hops(datasets) -> None:
    path = str(datasets["learnable"].test)
    questions = [EvalQuestion(path, example) for example in load_qa_dataset(path)]
    questions.append(EvalQuestion("toy.jsonl", QAExample("t", "Who?", ("A",), "toy")))
    records = [EvalRun._record(None, question, Trajectory(question.example.id, question.seed_group, 0, prompt_ids=[]),
                               "prompt", 0.0) for question in questions]
    assert [record.get("hops") for record in records] == [
        *(row["metadata"]["hops"] for row in read_jsonl(datasets["learnable"].test)), None]
