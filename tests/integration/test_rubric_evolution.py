"""Evolving rubrics in a training step's scoring (reward.rubric.evolve) against a scripted OpenAI-compatible judge and
generator on 127.0.0.1: a group's rubrics generated, judged with DR Tulu's score and filtered, the step's metrics, a
dead generator, eval on the static rubrics, the buffer through a real run checkpoint, and a replayed step."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlsearch.checkpoint import CheckpointStore
from rlsearch.config import (
    ConfigError,
    EndpointConfig,
    EvolveConfig,
    JudgeConfig,
    RewardConfig,
    RubricConfig,
    TrainConfig,
    load_train_config,
)
from rlsearch.data import QAExample, Rubric
from rlsearch.reward import RewardScorer
from rlsearch.reward.evolving import EvolvingRubric, RubricBuffer
from rlsearch.trainer.checkpoints import RUBRIC_BUFFER, checkpoint_to_resume, save_run_checkpoint
from rlsearch.trainer.progress import RunProgress
from rlsearch.trainer.sampler import SamplerState
from tests.integration.judge_stub import Scripted, answered, stub_judge
from tests.integration.threaded_server import closed_port

ROW = QAExample(id="velmora", question="Why did the Velmora guild collapse?", golden_answers=(),
                data_source="longform", rubrics=(Rubric("cites a primary source", 2.0),))
FLOOD, LATE = "<answer>The 1702 flood.</answer>", "<answer>It collapsed in 1800.</answer>"
CAUSE, DATE, POLITE = "Names the 1702 flood as the cause", "Dates the collapse to 1800", "Is polite"
STEP_1 = json.dumps({"positive_rubrics": [{"title": "Cause", "description": CAUSE}],
                     "negative_rubrics": [{"title": "Date", "description": DATE}]})
# step 2: a repeat of an active rubric (skipped) and one both answers meet (zero std: deactivated)
STEP_2 = json.dumps({"positive_rubrics": [{"description": CAUSE.upper()}, {"description": POLITE}]})
# the judge's 0-2 score per (criterion, answer)
SCORES = {("cites a primary source", FLOOD): 1, ("cites a primary source", LATE): 1, (CAUSE, FLOOD): 2,
          (CAUSE, LATE): 0, (DATE, FLOOD): 0, (DATE, LATE): 2, (POLITE, FLOOD): 2, (POLITE, LATE): 2}
_CRITERION, _ANSWER = re.compile(r"Criterion: (.*)"), re.compile(r"Answer: (.*)")


def script(prompt: str, attempt: int) -> Scripted:
    if prompt.startswith("You write grading rubrics"):
        return Scripted(STEP_2 if f'"{DATE}"' in prompt else STEP_1)
    answer = f"<answer>{_ANSWER.search(prompt)[1]}</answer>"
    return Scripted(f"Score: {SCORES[_CRITERION.search(prompt)[1], answer]}")


def group() -> list:
    trajectories = [answered(FLOOD, 0), answered(LATE, 0)]
    for index, trajectory in enumerate(trajectories):
        trajectory.sample_index = index
    return trajectories


def reward_config(url: str, cache_dir: str = "", replay: bool = False,
                  generators: list[EndpointConfig] | None = None) -> RewardConfig:
    return RewardConfig(scorers={"longform": "rubric"}, rubric=RubricConfig(evolve=EvolveConfig(
        enabled=True, endpoints=generators or [])), judge=JudgeConfig(
        base_url=url, model="stub-judge", cache_dir=cache_dir, replay=replay, max_retries=0, timeout_s=5.0))


def score_step(config: RewardConfig, buffer: RubricBuffer | None, step: int) -> tuple[list, dict[str, float]]:
    trajectories = group()
    scorer = RewardScorer(config)
    try:
        scorer.check([ROW])
        stats = scorer.score(trajectories, [ROW, ROW], buffer, step)
    finally:
        scorer.close()
    return trajectories, stats


def test_a_step_generates_judges_with_dr_tulus_score_and_filters_and_the_next_step_prunes() -> None:
    buffer = RubricBuffer()
    with stub_judge(script) as (stub, url):
        first, stats = score_step(reward_config(url), buffer, step=1)
        generator_prompt = stub.prompts[0]
        second, again = score_step(reward_config(url), buffer, step=2)
    # the generator saw the persistent rubric; the answers were judged on persistent + the two new ones
    assert 'Existing rubrics:\n[{"description": "cites a primary source", "weight": 2.0}]' in generator_prompt
    # sum(w s) / max(sum of positive w, 1): (2 * 0.5 + 1 * 1 - 1 * 0) / 3 and (2 * 0.5 + 0 - 1 * 1) / 3
    assert [t.scores["rubric"] for t in first] == [pytest.approx(2 / 3), 0.0]
    assert [t.reward for t in first] == [pytest.approx(2 / 3), 0.0]
    # each answer's score per rubric, in the order judged, kept in its trajectory record
    assert [[(s.text, s.weight, s.score) for s in t.rubric_scores] for t in first] == [
        [("cites a primary source", 2.0, 0.5), (CAUSE, 1.0, 1.0), (DATE, -1.0, 0.0)],
        [("cites a primary source", 2.0, 0.5), (CAUSE, 1.0, 0.0), (DATE, -1.0, 1.0)]]
    assert first[0].to_json()["rubric_scores"][1] == {"text": CAUSE, "weight": 1.0, "score": 1.0}
    assert stats == {
        "reward/rubrics_generated": 2.0, "reward/rubrics_activated": 2.0, "reward/rubrics_deactivated": 0.0,
        "reward/rubrics_active_per_question": 2.0, "reward/rubrics_generator_calls": 1.0,
        "reward/rubrics_generator_failures": 0.0, "reward/rubrics_generator_requests": 1.0,
        "reward/rubrics_judge_calls": 6.0, "reward/judged": 2.0, "reward/judge_requests": 6.0,
        "reward/judge_cache_hits": 0.0, "reward/judge_failures": 0.0, "reward/judge_failovers": 0.0}
    # step 2: the repeat skipped, "Is polite" judged (both meet it: (2 * 0.5 + 1 + 1 - 0) / 4) then deactivated
    assert [t.scores["rubric"] for t in second] == [pytest.approx(3 / 4), pytest.approx(1 / 4)]
    assert {key: again[f"reward/rubrics_{key}"] for key in ("generated", "activated", "deactivated",
                                                            "active_per_question", "judge_calls")} == {
        "generated": 2.0, "activated": 1.0, "deactivated": 1.0, "active_per_question": 2.0, "judge_calls": 8.0}
    rubrics = buffer.questions["velmora"]
    assert [(r.text, r.weight, r.added_step, r.std) for r in rubrics.active] == [(CAUSE, 1.0, 1, 0.5),
                                                                                 (DATE, -1.0, 1, 0.5)]
    assert [(r.text, r.added_step, r.std, r.removed_step) for r in rubrics.inactive] == [(POLITE, 2, 0.0, 2)]


def test_a_dead_generator_is_counted_and_the_group_keeps_its_active_rubrics() -> None:
    buffer = RubricBuffer()
    buffer.question("velmora", ROW.rubrics)
    buffer.add("velmora", [EvolvingRubric(CAUSE, 1.0)], step=1)
    dead = [EndpointConfig(f"http://127.0.0.1:{closed_port()}/v1", "generator")]
    with stub_judge(script) as (stub, url):
        trajectories, stats = score_step(reward_config(url, generators=dead), buffer, step=2)
    assert not any("You write grading rubrics" in prompt for prompt in stub.prompts)
    assert [t.scores["rubric"] for t in trajectories] == [pytest.approx(2 / 3), pytest.approx(1 / 3)]
    assert (stats["reward/rubrics_generator_calls"], stats["reward/rubrics_generator_failures"],
            stats["reward/rubrics_activated"], stats["reward/rubrics_judge_calls"]) == (1.0, 1.0, 0.0, 4.0)
    assert [rubric.text for rubric in buffer.questions["velmora"].active] == [CAUSE]


def test_eval_scores_on_the_static_rubrics_without_the_generator() -> None:
    with stub_judge(script) as (stub, url):
        trajectories, stats = score_step(reward_config(url), None, step=0)
    assert [t.scores["rubric"] for t in trajectories] == [0.5, 0.5]  # the static weighted mean
    assert len(stub.prompts) == 2 and not any(key.startswith("reward/rubrics_") for key in stats)


def _save_checkpoint(tmp_path: Path, store: CheckpointStore, buffer: RubricBuffer) -> TrainConfig:
    config = load_train_config(None, [f"model.path={tmp_path / 'hf'}", "trainer.resume=auto"])

    def save_checkpoint(directory: str, timeout_s: float) -> None:
        (Path(directory) / "__0_0.distcp").write_bytes(b"x")

    actor = SimpleNamespace(infos=[SimpleNamespace(transformer_impl="local")], save_checkpoint=save_checkpoint)
    save_run_checkpoint(config, actor, store, 1, SamplerState(0, 2), rubrics=buffer)
    return config


def test_the_buffer_is_saved_with_a_checkpoint_and_a_replayed_step_gives_the_same_rewards(tmp_path) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "qwen2"}')
    cache = str(tmp_path / "judge_cache")
    store = CheckpointStore(tmp_path / "run")
    buffer = RubricBuffer(max_active=4)
    with stub_judge(script) as (_, url):
        score_step(reward_config(url, cache), buffer, step=1)
        config = _save_checkpoint(tmp_path, store, buffer)
        recorded, recorded_stats = score_step(reward_config(url, cache), buffer, step=2)

    point = checkpoint_to_resume(config, store)
    assert (point.path / RUBRIC_BUFFER).is_file()
    assert point.rubrics["questions"]["velmora"]["active"][0]["text"] == CAUSE
    progress = RunProgress(rubrics=RubricBuffer(max_active=4))
    progress.rewind(point.step, point.sampler, point.rubrics)
    assert progress.rubrics.to_state() == point.rubrics and progress.rubrics.max_active == 4
    assert [rubric.text for rubric in progress.rubrics.questions["velmora"].active] == [CAUSE, DATE]

    # step 2 again from the resumed buffer, the judge and generator replayed from the cache with no server
    replay = reward_config(f"http://127.0.0.1:{closed_port()}/v1", cache, replay=True)
    replayed, replayed_stats = score_step(replay, progress.rubrics, step=2)
    assert [t.reward for t in replayed] == [t.reward for t in recorded]  # bit for bit
    assert progress.rubrics.to_state() == buffer.to_state()
    assert replayed_stats["reward/judge_requests"] == 0 and replayed_stats["reward/judge_cache_hits"] == 8
    assert replayed_stats["reward/rubrics_generator_requests"] == 0
    assert {key: value for key, value in replayed_stats.items() if "requests" not in key and "cache" not in key} == {
        key: value for key, value in recorded_stats.items() if "requests" not in key and "cache" not in key}

    # a run with no checkpoint yet (dead actor ranks before the first one) starts the buffer over
    progress.rewind(0, SamplerState())
    assert progress.rubrics.questions == {}


def test_a_generator_prompt_file_without_its_placeholders_stops_the_start_check(tmp_path) -> None:
    prompt = tmp_path / "generate.txt"
    prompt.write_text("Question: {question}\nResponses: {responses}\n")
    config = reward_config("http://127.0.0.1:9/v1")
    config.rubric.evolve.prompt_file = str(prompt)
    scorer = RewardScorer(config)
    with pytest.raises(ConfigError, match=r"'reward\.rubric\.evolve\.prompt_file' \(.*generate\.txt\) lacks the "
                                          r"placeholder \{existing_rubrics\}"):
        scorer.check([ROW])
