"""`rlsearch train` with evolving rubrics (reward.rubric.evolve) on `make-toy-data --task longform` data in the
call_tool protocol, the judge and the rubric generator being a scripted OpenAI-compatible server in this process
(tests/integration/judge_stub.py) that the driver reaches on 127.0.0.1: 2 steps with a checkpoint after each, then a
second invocation with trainer.total_steps=3 that resumes from step 2's checkpoint. Read back: the reward/rubrics_*
TensorBoard scalars of every step against the checkpoints' rubric_buffer.json and the trajectory records, each
answer's `rubric_scores` against the stub's scripted scores and its reward against DR Tulu's rule, the resumed
step's generator prompts holding the rubrics the saved buffer had active, and a rerun of the first 2 steps with
reward.judge.replay from the run's judge cache, the stub gone: the same rewards and buffers bit for bit."""

from __future__ import annotations

import itertools
import json
import re
import statistics
import sys
import zlib
from collections import Counter
from types import SimpleNamespace

import pytest

from rlsearch.reward.judge import PROMPTS_DIR
from rlsearch.reward.qa import extract_answer
from tests.drivers import run_from_repo, train_command
from tests.integration.judge_stub import Scripted, stub_judge

FIRST_STEPS, TOTAL_STEPS, GROUPS = 2, 3, 2  # 4 train questions, 2 a step: step 3 draws questions seen before
GENERATOR_PROMPT = "You write grading rubrics"
CRITERION, MISTAKE = "Generated criterion", "Generated mistake"  # the stub's positive and negative rubrics
# DR Tulu's terms beside the rubric score (its 0.5 / 0.2 / 0.2 / 0.1, here with the rubric score at 1)
FORMAT_WEIGHT, CITATION_WEIGHT, SEARCH_WEIGHT, MAX_SEARCHES = 0.2, 0.2, 0.1, 3
CALL_TOOL = ("rollout.protocol=call_tool", 'rollout.assistant_prefix=<call_tool name="search">',
             'rollout.logit_bias={"</call_tool>": 16.0}')
# SmolLM2-135M-Instruct answers the default rubric prompt ("Score: 0", "Score: 1" or "Score: 2") with prose and no
# score; asked for one word, yes or no (the shipped yes/no prompt), its first token is one
YES_NO_RUBRIC_PROMPT = PROMPTS_DIR / "rubric_yes_no.txt"
JUDGE_MAX_TOKENS, GENERATOR_MAX_TOKENS = 1, 192
_CRITERION = re.compile(r"\n\nCriterion: (.*)\n\nScore the answer", re.DOTALL)
_QUESTION = re.compile(r"^Question: (.*)$", re.MULTILINE)


class Script:
    """The stub's replies. A generator prompt gets one new positive and one new negative rubric (numbered over the
    module; `generated[question]` holds each call's pair). A judge prompt gets `score`."""

    def __init__(self) -> None:
        self.numbers = itertools.count(1)
        self.generated: dict[str, list[list[str]]] = {}
        self.first_answer: dict[str, str] = {}  # a generated positive rubric's first answer judged

    def __call__(self, prompt: str, attempt: int) -> Scripted:
        if prompt.startswith(GENERATOR_PROMPT):
            number = next(self.numbers)
            positive, negative = f"{CRITERION} {number}", f"{MISTAKE} {number}"
            self.generated.setdefault(_QUESTION.search(prompt)[1], []).append([positive, negative])
            return Scripted(json.dumps({"positive_rubrics": [{"title": "criterion", "description": positive}],
                                        "negative_rubrics": [{"title": "mistake", "description": negative}]}))
        answer = prompt.partition("\nAnswer: ")[2].partition("\n\nCriterion: ")[0]
        return Scripted(f"Score: {self.score(_CRITERION.search(prompt)[1], answer)}")

    def score(self, criterion: str, answer: str) -> int:
        """The 0-2 score: 0 on a negative rubric (zero std: the filter drops it in the step it came); on a positive
        one, 2 for the first answer judged and 0 or 1 by a hash for the others (it tells its first group's answers
        apart: it stays active); on the dataset's, 0-2 by a hash of the answer and the criterion."""
        digest = zlib.crc32(f"{criterion}\n{answer}".encode())
        if criterion.startswith(MISTAKE):
            return 0
        if criterion.startswith(CRITERION):
            return 2 if self.first_answer.setdefault(criterion, answer) == answer else digest % 2
        return digest % 3


def _scalars(run_dir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def _records(run_dir, step: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "trajectories" / f"step_{step:06d}.jsonl").open()]


def _buffer(run_dir, step: int) -> dict[str, dict]:
    return json.loads((run_dir / "checkpoints" / f"step_{step:06d}" / "rubric_buffer.json").read_text())["questions"]


def _generator_prompts(stub, question: str) -> list[str]:
    return [p for p in stub.prompts if p.startswith(GENERATOR_PROMPT) and _QUESTION.search(p)[1] == question]


@pytest.fixture(scope="module")
def longform(module_tmp):
    """5 long-form questions of 2 facts each, and the dir their BM25 index is cached in."""
    from rlsearch.data.longform import make_longform_data

    base = module_tmp.mktemp("longform")
    return SimpleNamespace(data=make_longform_data(base / "data", seed=0, num_questions=5, facts_per_question=2),
                           index_cache=base / "bm25")


def _train(tiny_model_dir, longform, out, driver_ray, total_steps: int, *overrides: str) -> str:
    """`rlsearch train` with evolving rubrics on `longform` and DR Tulu's terms; its output, once it succeeded."""
    command = train_command(
        tiny_model_dir, longform.data, longform.index_cache, out, f"trainer.total_steps={total_steps}", *CALL_TOOL,
        "reward.rubric.evolve.enabled=true", f"reward.rubric.format_weight={FORMAT_WEIGHT}",
        f"reward.rubric.citation_weight={CITATION_WEIGHT}", f"reward.rubric.search_weight={SEARCH_WEIGHT}",
        f"reward.rubric.max_searches={MAX_SEARCHES}", *overrides)
    result = run_from_repo(command, timeout=900, **driver_ray)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def rubric_run(module_tmp, tiny_model_dir, longform, driver_ray):
    """The 2-step run and its resumed third step, the stub's prompts after each."""
    from rlsearch.data import load_qa_dataset

    base = module_tmp.mktemp("rubric_run")
    run_dir, replay_dir, script = base / "run", base / "replay", Script()

    def train(out, url: str, total_steps: int, *overrides: str) -> str:
        return _train(tiny_model_dir, longform, out, driver_ray, total_steps, f"reward.judge.base_url={url}",
                      "reward.judge.model=stub-judge", *overrides)

    with stub_judge(script) as (stub, url):
        first_output = train(run_dir, url, FIRST_STEPS)
        first_prompts = list(stub.prompts)
        resumed_output = train(run_dir, url, TOTAL_STEPS)
    # the judge's and the generator's replies from the run's cache alone: the stub's port is closed now
    replay_output = train(replay_dir, url, FIRST_STEPS, "reward.judge.replay=true",
                          f"reward.judge.cache_dir={run_dir / 'judge_cache'}")
    rows = {example.id: example for example in load_qa_dataset(str(longform.data.train))}
    return SimpleNamespace(dir=run_dir, stub=stub, script=script, rows=rows, first_output=first_output,
                           first_prompts=first_prompts, resumed_output=resumed_output, replay_dir=replay_dir,
                           replay_output=replay_output)


def test_every_step_reports_its_rubrics_as_its_checkpoint_and_records_hold_them(rubric_run):
    scalars, steps = _scalars(rubric_run.dir), _steps_of_questions(rubric_run.dir)
    for step in range(1, TOTAL_STEPS + 1):
        records, buffer = _records(rubric_run.dir, step), _buffer(rubric_run.dir, step)
        questions = sorted({record["example_id"] for record in records})
        assert len(questions) == GROUPS and set(questions) <= set(buffer), step
        metric = {tag.removeprefix("reward/rubrics_"): values[step] for tag, values in scalars.items()
                  if tag.startswith("reward/rubrics_")}
        # one generator call a group, each reply's two rubrics new to the question and added
        assert (metric["generator_calls"], metric["generator_requests"], metric["generator_failures"],
                metric["generated"], metric["activated"]) == (GROUPS, GROUPS, 0, 2 * GROUPS, 2 * GROUPS), step
        added = [rubric for key in questions for rubric in buffer[key]["active"] + buffer[key]["inactive"]
                 if rubric["added_step"] == step]
        # the rubrics the generator returned for each question's group of this step (its n-th call, in its n-th step)
        replies = [text for key in questions
                   for text in rubric_run.script.generated[rubric_run.rows[key].question][steps[key].index(step)]]
        assert sorted(rubric["text"] for rubric in added) == sorted(replies), step
        removed = [rubric for key in questions for rubric in buffer[key]["inactive"] if rubric["removed_step"] == step]
        # every negative rubric scored the whole group 0: it left in the step it came; the positive stayed
        assert sorted(rubric["text"] for rubric in removed if rubric["added_step"] == step) == sorted(
            text for text in replies if text.startswith(MISTAKE)), step
        assert metric["deactivated"] == len(removed), step
        assert metric["active_per_question"] == pytest.approx(
            statistics.fmean(len(buffer[key]["active"]) for key in questions)), step
        assert metric["judge_calls"] == sum(len(record["rubric_scores"]) for record in records), step
        assert scalars["reward/mean"][step] == pytest.approx(statistics.fmean(r["reward"] for r in records)), step
        print(f"\nstep {step}: " + ", ".join(f"{key} {value:g}" for key, value in sorted(metric.items()))
              + f"; reward/mean {scalars['reward/mean'][step]:.4f}")


def _steps_of_questions(run_dir) -> dict[str, list[int]]:
    steps: dict[str, list[int]] = {}
    for step in range(1, TOTAL_STEPS + 1):
        for key in sorted({record["example_id"] for record in _records(run_dir, step)}):
            steps.setdefault(key, []).append(step)
    return steps


def test_each_answer_is_scored_on_its_questions_rubrics_with_dr_tulus_rule(rubric_run):
    varied = tool_calls = cited = 0
    for step in range(1, TOTAL_STEPS + 1):
        records, buffer = _records(rubric_run.dir, step), _buffer(rubric_run.dir, step)
        for record in records:
            question = buffer[record["example_id"]]
            persistent = [rubric["text"] for rubric in question["persistent"]]
            assert persistent == [rubric.text for rubric in rubric_run.rows[record["example_id"]].rubrics]
            judged_then = [rubric["text"] for rubric in question["active"] + question["inactive"]
                           if rubric["added_step"] <= step and rubric["removed_step"] in (None, step)]
            texts = [score["text"] for score in record["rubric_scores"]]
            assert texts[:len(persistent)] == persistent and sorted(texts[len(persistent):]) == sorted(judged_then)
            text = record["assistant_prefix"] + "".join(turn["text"] for turn in record["turns"])
            answer = extract_answer(text) or text
            assert [score["score"] for score in record["rubric_scores"]] == [
                rubric_run.script.score(score["text"], answer) / 2 for score in record["rubric_scores"]]
            weighted = sum(score["weight"] * score["score"] for score in record["rubric_scores"])
            positive = sum(score["weight"] for score in record["rubric_scores"] if score["weight"] > 0)
            assert record["scores"]["rubric"] == pytest.approx(weighted / max(positive, 1.0))
            calls = sum(len(turn["tool_calls"]) for turn in record["turns"])
            assert record["scores"]["search"] == min(calls, MAX_SEARCHES) / MAX_SEARCHES
            tool_calls, cited = tool_calls + calls, cited + int(record["scores"]["citation"])
            assert record["reward"] == pytest.approx(
                record["scores"]["rubric"] + FORMAT_WEIGHT * record["scores"]["format"]
                + CITATION_WEIGHT * record["scores"]["citation"] + SEARCH_WEIGHT * record["scores"]["search"])
        for key in {record["example_id"] for record in records}:
            varied += len({record["reward"] for record in records if record["example_id"] == key}) > 1
    print(f"\n{tool_calls} tool calls, {cited} answers citing a shown snippet over {TOTAL_STEPS} steps")
    assert varied == TOTAL_STEPS * GROUPS  # every group's rewards differ: GRPO has advantages to train on


def test_the_resumed_run_continues_with_the_saved_buffer(rubric_run):
    assert "step 2/2 | reward" in rubric_run.first_output
    assert "step_000002 after step 2" in rubric_run.resumed_output
    assert "step 1/3" not in rubric_run.resumed_output and "step 3/3 | reward" in rubric_run.resumed_output
    saved, resumed = _buffer(rubric_run.dir, 2), _buffer(rubric_run.dir, 3)
    restored = 0
    for key in sorted({record["example_id"] for record in _records(rubric_run.dir, 3)}):
        question = rubric_run.rows[key].question
        # the resumed step's generator call was shown the saved buffer's rubrics: the persistent and active ones
        (prompt,) = [p for p in _generator_prompts(rubric_run.stub, question)
                     if p not in rubric_run.first_prompts]
        shown = json.loads(prompt.rpartition("Existing rubrics:\n")[2])
        assert [rubric["description"] for rubric in shown] == [
            rubric["text"] for rubric in saved[key]["persistent"] + saved[key]["active"]]
        restored += len(saved[key]["active"])
        # and every rubric the question had is in the resumed step's buffer, added when it was
        after = {rubric["text"]: rubric for rubric in resumed[key]["active"] + resumed[key]["inactive"]}
        for rubric in saved[key]["active"] + saved[key]["inactive"]:
            assert after[rubric["text"]]["added_step"] == rubric["added_step"] < 3
            assert after[rubric["text"]]["removed_step"] in (rubric["removed_step"], 3)
    # each step-3 question was drawn once in steps 1-2, and its positive rubric of then told its answers apart
    assert restored == GROUPS
    # a generator call per group per step, never repeated for a step the resume had done
    assert sum(p.startswith(GENERATOR_PROMPT) for p in rubric_run.stub.prompts) == TOTAL_STEPS * GROUPS


def test_a_replay_from_the_runs_judge_cache_gives_its_rewards_and_buffers_without_a_server(rubric_run):
    """The first 2 steps again with reward.judge.replay, the stub's port closed: the same tokens, rewards, per-rubric
    scores and rubric buffers bit for bit, no request sent; the share of each step's time spent in reward printed
    (the issue's goal: <= 5% with a warm cache)."""
    original, replayed = _scalars(rubric_run.dir), _scalars(rubric_run.replay_dir)
    for step in range(1, FIRST_STEPS + 1):
        ours, theirs = _records(rubric_run.replay_dir, step), _records(rubric_run.dir, step)
        assert [r["response_ids"] for r in ours] == [r["response_ids"] for r in theirs], step
        assert [(r["reward"], r["rubric_scores"]) for r in ours] == [(r["reward"], r["rubric_scores"])
                                                                   for r in theirs], step
        assert _buffer(rubric_run.replay_dir, step) == _buffer(rubric_run.dir, step), step
        assert replayed["reward/rubrics_generator_failures"][step] == 0.0
        for tag in ("reward/rubrics_generator_calls", "reward/rubrics_judge_calls"):
            assert replayed[tag][step] == original[tag][step], (tag, step)
        share = replayed["time/reward_s"][step] / replayed["time/step_s"][step]
        print(f"\nreplayed step {step}: reward {replayed['time/reward_s'][step]:.3f} s of "
              f"{replayed['time/step_s'][step]:.2f} s ({share:.1%}; the recorded run's "
              f"{original['time/reward_s'][step]:.3f} s)")


@pytest.fixture(scope="module")
def frozen_judge_run(module_tmp, tiny_model_dir, smollm2_dir, longform, driver_ray):
    """A step whose judge and rubric generator are SmolLM2-135M-Instruct, served by a frozen engine of the run
    (reward.judge.engine), then the step replayed from the run's judge cache, which starts no engine; and an
    `rlsearch eval` of the test questions judged by a frozen engine of its own."""
    base = module_tmp.mktemp("frozen_judge")
    settings = (f"reward.judge.engine={smollm2_dir}", f"reward.judge.rubric_prompt_file={YES_NO_RUBRIC_PROMPT}",
                f"reward.judge.max_tokens={JUDGE_MAX_TOKENS}",
                f"reward.rubric.evolve.max_tokens={GENERATOR_MAX_TOKENS}")
    output = _train(tiny_model_dir, longform, base / "run", driver_ray, 1, *settings)
    replay_output = _train(tiny_model_dir, longform, base / "replay", driver_ray, 1, *settings,
                           "reward.judge.replay=true", f"reward.judge.cache_dir={base / 'run' / 'judge_cache'}")
    evaluation = run_from_repo([
        sys.executable, "-m", "rlsearch", "eval", "--config", "examples/configs/eval_search.yaml", *CALL_TOOL,
        f"model.path={tiny_model_dir}", f"eval.files=[{longform.data.test}]",
        f"tools.retriever.corpus={longform.data.corpus}", f"tools.retriever.index_cache_dir={longform.index_cache}",
        f"output_dir={base / 'eval'}", *settings[:3]], timeout=900)
    assert evaluation.returncode == 0, evaluation.stdout[-3000:] + evaluation.stderr[-3000:]
    return SimpleNamespace(dir=base / "run", output=output, replay_dir=base / "replay", replay_output=replay_output,
                           eval_dir=base / "eval", eval_questions=len(longform.data.test.read_text().splitlines()))


@pytest.mark.memory_heavy  # the tiny policy's engine and rank, and SmolLM2's engine
def test_a_frozen_engine_of_the_run_judges_and_writes_rubrics_and_a_replay_needs_none(frozen_judge_run, smollm2_dir):
    """Every reply the step used came from the frozen SmolLM2 engine (cached under its path as the model name); what
    the parser made of each of its replies is what the records and metrics say: a verdict where it found one (the
    records' scores), a failed trajectory where it found none, a generator failure for a reply that is no rubric
    JSON. The replay gives the same rewards, scores and buffer, its start-up without the engine."""
    from rlsearch.reward.rubric_generator import parse_generated
    from rlsearch.reward.verdict import parse_verdict

    assert "step 1/1 | reward" in frozen_judge_run.output and "frozen judge" in frozen_judge_run.output
    replies = [json.loads(path.read_text()) for path in (frozen_judge_run.dir / "judge_cache").rglob("*.json")]
    assert replies and all(r["model"] == r["answered_by"] == str(smollm2_dir) for r in replies)
    generated = [r for r in replies if r["prompt"].startswith(GENERATOR_PROMPT)]
    judged = [r for r in replies if not r["prompt"].startswith(GENERATOR_PROMPT)]
    scalars = {tag: values[1] for tag, values in _scalars(frozen_judge_run.dir).items()}
    assert scalars["reward/rubrics_generator_requests"] == scalars["reward/rubrics_generator_calls"] == len(
        generated) == GROUPS
    assert scalars["reward/rubrics_generator_failures"] == sum(parse_generated(r["reply"]) is None for r in generated)
    assert scalars["reward/judge_requests"] == len(judged)
    verdicts = [parse_verdict(r["reply"], 2) for r in judged]
    records = _records(frozen_judge_run.dir, 1)
    scored = [score["score"] for record in records if not record["failed"] for score in record["rubric_scores"]]
    assert not Counter(scored) - Counter(v for v in verdicts if v is not None)  # each score is one of its verdicts
    assert all(record["failed"].startswith("judge:") for record in records if record["failed"])
    assert sum(bool(record["failed"]) for record in records) <= verdicts.count(None)
    for record in records:
        if not record["failed"]:
            weighted = sum(score["weight"] * score["score"] for score in record["rubric_scores"])
            positive = sum(score["weight"] for score in record["rubric_scores"] if score["weight"] > 0)
            assert record["scores"]["rubric"] == pytest.approx(weighted / max(positive, 1.0))
    print(f"\nSmolLM2 as the judge: {len(judged)} replies, {verdicts.count(None)} without a verdict, e.g. "
          f"{[r['reply'] for r in judged[:3]]}; as the generator: {len(generated)} replies, "
          f"{scalars['reward/rubrics_generator_failures']:g} not rubric JSON, e.g. {generated[0]['reply'][:200]!r}")

    assert "frozen judge" not in frozen_judge_run.replay_output  # no engine: every reply came from the cache
    replayed = _records(frozen_judge_run.replay_dir, 1)
    assert [(r["response_ids"], r["reward"], r["rubric_scores"], r["failed"]) for r in replayed] == [
        (r["response_ids"], r["reward"], r["rubric_scores"], r["failed"]) for r in records]
    assert _buffer(frozen_judge_run.replay_dir, 1) == _buffer(frozen_judge_run.dir, 1)


@pytest.mark.memory_heavy
def test_an_eval_is_judged_by_a_frozen_engine_of_its_own(frozen_judge_run, smollm2_dir):
    """`rlsearch eval` with reward.judge.engine: every judgement of the eval's trajectories was asked of its frozen
    SmolLM2 engine, and each record's rubric scores are verdicts parsed from those replies."""
    from rlsearch.reward.verdict import parse_verdict

    replies = [json.loads(path.read_text()) for path in (frozen_judge_run.eval_dir / "judge_cache").rglob("*.json")]
    assert replies and all(r["model"] == r["answered_by"] == str(smollm2_dir) for r in replies)
    records = [json.loads(line) for line in (frozen_judge_run.eval_dir / "trajectories.jsonl").open()]
    assert len(records) == frozen_judge_run.eval_questions
    verdicts = Counter(v for v in (parse_verdict(r["reply"], 2) for r in replies) if v is not None)
    scored = Counter(score["score"] for record in records if not record["failed"]
                     for score in record["rubric_scores"])
    assert sum(scored.values()) > 0 and not scored - verdicts
