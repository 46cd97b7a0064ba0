"""The eval harness end to end with a scripted oracle in place of the vLLM engine.

The oracle searches the question and answers with the golden answer it reads in the retrieved passages, so EM is
1.0 exactly when retrieval, the tool-call parser, observation rendering, scoring and summarising all work. Every
other part is the real `rlsearch eval` path: config, RolloutWorker, agent loop, HTTP retriever, results file.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pyarrow
import pyarrow.parquet
import pytest
from threaded_server import closed_port, scripted_retriever
from transformers import AutoTokenizer

from rlsearch.config import (
    ConfigError,
    EvalConfig,
    EvalSettings,
    ModelConfig,
    RetrieverConfig,
    RewardConfig,
    RolloutConfig,
    ToolsConfig,
    validate_eval_config,
)
from rlsearch.data import load_qa_dataset
from rlsearch.eval import OVERALL, run_eval
from rlsearch.reward import ScorerError


class OracleEngine:
    """Engine-shaped: `tokenizer`, `weight_version` and coroutines `generate(token_id_prompts, sampling_params)`
    (vLLM-like outputs) and `shutdown()`."""

    weight_version = 0

    def __init__(self, tokenizer, golden_by_question: dict[str, tuple[str, ...]]) -> None:
        self.tokenizer = tokenizer
        self.golden_by_question = golden_by_question
        self.completions = 0

    async def generate(self, prompts: list[list[int]], sampling_params: list) -> list:
        return [self._complete(token_ids, params.stop) for token_ids, params in zip(prompts, sampling_params)]

    async def shutdown(self) -> None:
        pass

    def _complete(self, token_ids: list[int], stop_strings: list[str]) -> SimpleNamespace:
        self.completions += 1
        text = self.tokenizer.decode(token_ids)
        assistant_turn = text.rsplit("<|im_start|>assistant", 1)[1]
        question = next(q for q in self.golden_by_question if q in text)
        if "<information>" not in assistant_turn:
            completion = f"<search> {question} </search>"
        else:
            observation = assistant_turn.rsplit("<information>", 1)[1]
            found = [answer for answer in self.golden_by_question[question] if answer in observation]
            completion = f"<answer> {found[0] if found else 'not found'} </answer>"
        ids = self.tokenizer.encode(completion, add_special_tokens=False)
        (stop,) = [s for s in stop_strings if completion.endswith(s)]
        output = SimpleNamespace(token_ids=ids, logprobs=[{token: SimpleNamespace(logprob=0.0)} for token in ids],
                                 text=completion, finish_reason="stop", stop_reason=stop)
        return SimpleNamespace(outputs=[output], num_cached_tokens=0)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def oracle(monkeypatch, tiny_tokenizer, toy_data, tmp_path):
    """Replaces the vLLM engine that RolloutWorker builds with the oracle; yields the engines it made."""
    rows = [json.loads(line) for line in toy_data.test.open()]
    parquet_file = tmp_path / "toy_test.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([{**row, "data_source": "toy_parquet"} for row in rows]),
                                parquet_file)
    golden = {example.question: example.golden_answers for example in load_qa_dataset(toy_data.test)}
    engines: list[OracleEngine] = []

    def make_engine(spec):
        engines.append(OracleEngine(tiny_tokenizer, golden))
        return engines[-1]

    monkeypatch.setattr("rlsearch.rollout.worker.VLLMEngine", make_engine)
    return SimpleNamespace(engines=engines, files=[str(toy_data.test), str(parquet_file)], num_questions=len(rows))


def _config(oracle, tiny_model_dir, retriever, output_dir, max_turns=3, scorers=None, **eval_settings
            ) -> EvalConfig:
    return validate_eval_config(EvalConfig(
        reward=RewardConfig(scorers={"toy_parquet": "em"} if scorers is None else scorers),
        eval=EvalSettings(files=oracle.files, batch_size=4, **eval_settings),
        model=ModelConfig(path=str(tiny_model_dir)),
        rollout=RolloutConfig(temperature=1.0, max_turns=max_turns, max_response_tokens=512),
        tools=ToolsConfig(retriever=RetrieverConfig(url=retriever.url, topk=3, max_retries=1, backoff_s=0.01)),
        output_dir=str(output_dir),
    ))


def test_oracle_scores_em_1_on_jsonl_and_parquet_with_pass_at_k(oracle, tiny_model_dir, retriever, tmp_path):
    summary = run_eval(_config(oracle, tiny_model_dir, retriever, tmp_path / "out", n_samples=2))
    assert list(summary.metrics) == ["toy", "toy_parquet", OVERALL]
    for group in summary.metrics.values():
        assert group["em"] == group["f1"] == group["substring_em"] == group["answer_rate"] == 1.0
        assert group["pass@2"] == group["mean@2"] == 1.0
        assert group["turns"] == 2.0 and group["tool_calls"] == 1.0 and group["invalid_call_rate"] == 0.0
    assert summary.metrics[OVERALL]["questions"] == 2 * oracle.num_questions
    assert summary.metrics[OVERALL]["samples"] == 4 * oracle.num_questions
    records = [json.loads(line) for line in (tmp_path / "out" / "trajectories.jsonl").open()]
    assert len(records) == 4 * oracle.num_questions
    first = records[0]
    assert first["question"] in first["prompt"] and first["answer"] in first["golden_answers"]
    assert [call["query"] for call in first["turns"][0]["tool_calls"]] == [first["question"]]
    assert first["turns"][0]["observation"].startswith("\n\n<information>Doc 1(Title:")
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["metrics"] == summary.metrics


def test_a_source_without_scorer_stops_the_eval_before_any_engine(oracle, tiny_model_dir, retriever, tmp_path):
    with pytest.raises(ScorerError, match=r"toy_test.parquet: row 1: data_source 'toy_parquet' has no scorer"):
        run_eval(_config(oracle, tiny_model_dir, retriever, tmp_path / "out", scorers={}))
    assert oracle.engines == []


def test_rerun_generates_only_what_is_missing(oracle, tiny_model_dir, retriever, tmp_path):
    config = _config(oracle, tiny_model_dir, retriever, tmp_path / "out", max_examples=3)
    first = run_eval(config)
    results = tmp_path / "out" / "trajectories.jsonl"
    lines = results.read_text().splitlines(keepends=True)
    results.write_text("".join(lines[:2]) + lines[2][:25])  # as if killed while writing the third record
    second = run_eval(config)
    assert (second.generated, second.resumed) == (len(lines) - 2, 2)
    assert {k: v for k, v in second.metrics[OVERALL].items() if k != "time_s"} == \
        {k: v for k, v in first.metrics[OVERALL].items() if k != "time_s"}
    assert len(results.read_text().splitlines()) == len(lines)

    engines_before = len(oracle.engines)
    third = run_eval(config)  # everything scored: no engine, no retriever
    assert (third.generated, third.resumed) == (0, len(lines)) and len(oracle.engines) == engines_before

    with pytest.raises(ConfigError, match=r"holds results of another eval: 'rollout\.max_turns' was 3, now 2"):
        run_eval(_config(oracle, tiny_model_dir, retriever, tmp_path / "out", max_turns=2, max_examples=3))


def test_a_dead_retriever_stops_the_eval_and_what_a_failing_one_spoiled_is_generated_again(
        oracle, tiny_model_dir, retriever, tmp_path, capsys):
    dead = SimpleNamespace(url=f"http://127.0.0.1:{closed_port()}")
    with pytest.raises(ConfigError, match=rf"^'tools\.retriever\.url' is {dead.url}, but a test search there failed: "):
        run_eval(_config(oracle, tiny_model_dir, dead, tmp_path / "out"))
    assert oracle.engines == []

    # up for the start-up search, then every search is answered 503: the scores are the retriever's
    with scripted_retriever([(200, {"result": [[]]}), (503, {"detail": "overloaded"})]) as url:
        spoiled = run_eval(_config(oracle, tiny_model_dir, SimpleNamespace(url=url), tmp_path / "out", max_examples=2))
    overall = spoiled.metrics[OVERALL]
    assert (overall["samples"], overall["em"], overall["tool_calls"], overall["tool_failures"]) == (4, 0.0, 1.0, 4)
    assert spoiled.warning == (
        f"WARNING: 4 of 4 tool calls failed (first: search: {url}/retrieve failed after 2 attempts; last error: HTTP "
        '503: {"detail":"overloaded"}); the scores measure the tools, not the model. Fix the tool '
        "('tools.retriever.url' for search) and run again into the same output_dir: it generates again the 4 "
        "trajectories whose tool was unavailable")
    assert spoiled.render().endswith(f"rlsearch: {spoiled.warning}")
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["metrics"][OVERALL]["tool_failures"] == 4

    fixed = run_eval(_config(oracle, tiny_model_dir, retriever, tmp_path / "out", max_examples=2))
    assert (fixed.generated, fixed.resumed, fixed.warning) == (4, 0, "")
    assert (fixed.metrics[OVERALL]["em"], fixed.metrics[OVERALL]["tool_failures"]) == (1.0, 0)
    assert "4 trajectories of an earlier run met an unavailable tool" in capsys.readouterr().out
    assert len((tmp_path / "out" / "trajectories.jsonl").read_text().splitlines()) == 4
