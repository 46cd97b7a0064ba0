"""`rlsearch eval` end to end on CPU: the run script, every summary metric recomputed from the trajectories, a run
killed with SIGKILL that resumes to the same results as an uninterrupted one, and a replay of the uninterrupted run
from its tool store alone."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict
from types import SimpleNamespace

import pytest

from rlsearch.reward import exact_match, extract_answer, f1_score, substring_match
from tests.constants import REPO_ROOT

CONFIG = "examples/configs/eval_search.yaml"
QUESTIONS, SAMPLES = 4, 2
TIME_KEYS = ("time_s", "wall_s", "latency_s", "generate_s", "tool_s")
# besides times, what differs between runs of the same results: whether a call was answered by the run's tool store
RUN_KEYS = (*TIME_KEYS, "cached")


def _overrides(assets, output_dir, batch_size):
    return [
        f"model.path={assets.model}", f"eval.files=[{assets.data.test}]",
        f"tools.retriever.corpus={assets.data.corpus}", f"tools.retriever.index_cache_dir={assets.index_cache}",
        f"eval.max_examples={QUESTIONS}",
        f"eval.n_samples={SAMPLES}", f"eval.batch_size={batch_size}", f"output_dir={output_dir}",
    ]


def _records(output_dir):
    return [json.loads(line) for line in (output_dir / "trajectories.jsonl").open()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir, toy_data):
    base = tmp_path_factory.mktemp("eval_runs")
    assets = SimpleNamespace(model=tiny_model_dir, data=toy_data, index_cache=base / "bm25")
    reference_dir, resumed_dir = base / "reference", base / "resumed"
    started = time.perf_counter()
    # The uninterrupted run (through the run script) and the run to be killed go side by side: vLLM on CPU serves
    # with one thread, so the two share the cores at little cost.
    reference_log = base / "reference.log"
    with reference_log.open("w") as log:  # a file, not a pipe: nobody reads a pipe while the other run is watched
        reference = subprocess.Popen(
            ["bash", "examples/run_search_eval.sh", *_overrides(assets, reference_dir, 2), f"log_dir={reference_dir}"],
            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
        )
    # its own process group, so that SIGKILL reaches its retriever server too
    doomed = subprocess.Popen(
        [sys.executable, "-m", "rlsearch", "eval", "--config", CONFIG, *_overrides(assets, resumed_dir, 2)],
        cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    results = resumed_dir / "trajectories.jsonl"
    deadline = time.monotonic() + 600
    while not (results.is_file() and results.stat().st_size) and doomed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert doomed.poll() is None, "the run to be killed ended before writing its first batch"
    os.killpg(doomed.pid, signal.SIGKILL)  # no cleanup runs
    doomed.wait()
    killed_records = results.read_text().count("\n")  # complete records; a torn last line is dropped on resume
    reference.wait(timeout=600)
    stdout = reference_log.read_text()
    assert reference.returncode == 0, stdout[-6000:]
    # the replay: no corpus, so a retriever could not even start
    replay_dir = base / "replay"
    replay = subprocess.Popen(
        [sys.executable, "-m", "rlsearch", "eval", "--config", CONFIG, *_overrides(assets, replay_dir, 2),
         "tools.replay=true", f"tools.cache_dir={reference_dir / 'tool_store'}", "tools.retriever.corpus=/nonexistent"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    resumed = subprocess.run(
        [sys.executable, "-m", "rlsearch", "eval", "--config", CONFIG, *_overrides(assets, resumed_dir, 3)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    replay_output, _ = replay.communicate(timeout=600)
    assert replay.returncode == 0, replay_output[-3000:]
    print(f"\nreference + killed run side by side, then the resumed run: {time.perf_counter() - started:.0f} s")
    return SimpleNamespace(reference_dir=reference_dir, reference_stdout=stdout, resumed_dir=resumed_dir,
                           resumed_stdout=resumed.stdout, killed_records=killed_records, replay_dir=replay_dir)


def _recompute(records):
    """The summary's metrics, computed here from the trajectories' text, turns and token ids alone."""
    groups = defaultdict(list)
    for record in records:
        text = record["assistant_prefix"] + "".join(turn["text"] for turn in record["turns"])
        answer = extract_answer(text)
        golden = record["golden_answers"]
        scores = {
            "em": exact_match(answer, golden) if answer is not None else 0.0,
            "f1": f1_score(answer, golden) if answer is not None else 0.0,
            "substring_em": substring_match(answer, golden) if answer is not None else 0.0,
            "has_answer": float(answer is not None),
            "valid_search": float(any(turn["tool_calls"] for turn in record["turns"])
                                  and not any(turn["kind"] == "invalid_call" for turn in record["turns"])),
        }
        assert record["answer"] == answer and record["scores"] == scores
        groups[record["data_source"]].append((record, scores))
        groups["overall"].append((record, scores))
    expected = {}
    for name, members in groups.items():
        count = len(members)
        kinds = [turn["kind"] for record, _ in members for turn in record["turns"]]
        em_per_question = defaultdict(list)
        for record, scores in members:
            em_per_question[record["example_id"]].append(scores["em"])
        expected[name] = {
            "questions": len(em_per_question), "samples": count,
            **{key: sum(scores[score] for _, scores in members) / count for key, score in
               (("em", "em"), ("f1", "f1"), ("substring_em", "substring_em"), ("answer_rate", "has_answer"))},
            "turns": len(kinds) / count,
            "tool_calls": kinds.count("tool_call") / count,
            # calls that reached their tool and failed there (timed out, a tool error)
            "tool_failures": sum(call["error_kind"] in ("timeout", "tool_error") for record, _ in members
                                 for turn in record["turns"] for call in turn["tool_calls"]),
            "invalid_call_rate": kinds.count("invalid_call") / max(1, kinds.count("tool_call") + kinds.count(
                "invalid_call")),
            "response_tokens": sum(len(record["response_ids"]) for record, _ in members) / count,
            "time_s": sum(record["time_s"] for record, _ in members),
            "failed": sum(bool(record["failed"]) for record, _ in members),
            f"pass@{SAMPLES}": sum(max(ems) for ems in em_per_question.values()) / len(em_per_question),
            f"mean@{SAMPLES}": sum(sum(ems) / len(ems) for ems in em_per_question.values()) / len(em_per_question),
        }
    return expected


def test_every_summary_metric_matches_the_trajectories(runs):
    summary = json.loads((runs.reference_dir / "summary.json").read_text())
    records = _records(runs.reference_dir)
    assert len(records) == QUESTIONS * SAMPLES
    expected = _recompute(records)
    assert summary["metrics"].keys() == expected.keys()
    for group, metrics in expected.items():
        assert summary["metrics"][group] == pytest.approx(metrics, rel=1e-12), group
    assert any(turn["kind"] == "tool_call" for record in records for turn in record["turns"]), \
        "the embedded default is meant to exercise the tool path"
    overall = summary["metrics"]["overall"]
    table_row = next(line for line in runs.reference_stdout.splitlines() if line.startswith("overall "))
    assert f"{overall['em']:.3f}" in table_row and f"{overall['turns']:.2f}" in table_row
    assert f"summary      : {runs.reference_dir / 'summary.json'}" in runs.reference_stdout


def test_eval_prints_no_library_output_and_names_its_logs(runs):
    """One engine runs vLLM in the eval's own process: its engine core's and the libraries' output still goes to
    output_dir/logs/driver.log, and the terminal holds the progress lines, the table and the summary."""
    terminal = runs.reference_stdout.splitlines()
    assert f"library logs     : {runs.reference_dir / 'logs'}" in terminal[-1]
    assert not [line for line in terminal if re.search(r"WARNING|Triton|LD_PRELOAD|Loading|it/s|pid=", line)]
    assert len(terminal) <= 20, terminal
    assert "vllm" in (runs.reference_dir / "logs" / "driver.log").read_text().lower()


def test_reference_run_logs_tensorboard_scalars(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(runs.reference_dir / "tensorboard"))
    events.Reload()
    summary = json.loads((runs.reference_dir / "summary.json").read_text())
    for group, metrics in summary["metrics"].items():
        for name, value in metrics.items():
            (event,) = events.Scalars(f"eval/{group}/{name}")
            assert event.step == 0 and event.value == pytest.approx(value, rel=1e-6)


def test_killed_run_resumes_to_the_uninterrupted_results(runs):
    assert 0 < runs.killed_records < QUESTIONS * SAMPLES
    assert f"{runs.killed_records} resumed)" in runs.resumed_stdout

    def without_time(value):
        if isinstance(value, dict):
            return {key: without_time(item) for key, item in value.items() if key not in RUN_KEYS}
        if isinstance(value, list):
            return [without_time(item) for item in value]
        return value

    reference = json.loads((runs.reference_dir / "summary.json").read_text())
    resumed = json.loads((runs.resumed_dir / "summary.json").read_text())
    assert without_time(resumed["metrics"]) == without_time(reference["metrics"])
    def by_key(output_dir):
        return {(r["example_id"], r["sample_index"]): without_time(r) for r in _records(output_dir)}

    reference_records, resumed_records = by_key(runs.reference_dir), by_key(runs.resumed_dir)
    assert resumed_records.keys() == reference_records.keys()
    for key, reference_record in reference_records.items():
        # other batch neighbours change the float rounding of logprobs, never the sampled tokens
        resumed_logprobs = resumed_records[key].pop("rollout_logprobs")
        assert resumed_logprobs == pytest.approx(reference_record.pop("rollout_logprobs"), abs=1e-4)
        assert resumed_records[key] == reference_record, key


def test_a_replay_from_the_tool_store_makes_no_call_and_samples_the_same_tokens(runs):
    reference = {(r["example_id"], r["sample_index"]): r for r in _records(runs.reference_dir)}
    replayed = {(r["example_id"], r["sample_index"]): r for r in _records(runs.replay_dir)}
    assert replayed.keys() == reference.keys() and len(replayed) == QUESTIONS * SAMPLES
    calls = [call for r in replayed.values() for turn in r["turns"] for call in turn["tool_calls"]]
    assert calls and all(call["cached"] and call["ok"] for call in calls)  # every result came from the store
    for key, record in replayed.items():
        assert record["response_ids"] == reference[key]["response_ids"], key
    assert not (runs.replay_dir / "tool_store").exists()  # nothing recorded anew
