"""Scoring trajectories: each with its row's scorer (registry.py decides which). Rule scorers run inline; the judge
and rubric scorers ask an LLM judge, every judged trajectory's requests in flight together (bounded by
reward.judge.max_concurrency), so one slow reply does not serialise a step.

A trajectory the judge cannot score (retries exhausted, a refused request, a reply with no verdict) gets
``failed = "judge: ..."``: it is left out of training and counted in ``reward/judge_failures``, never scored 0.

In training with reward.rubric.evolve, the rubric scorer's rows are scored by prompt group on their question's
evolving rubrics (rubric_step.py; the trainer passes its `RubricBuffer`); eval scores them on the static rubrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rlsearch.config import RewardConfig
from rlsearch.config.prompt import PromptFile
from rlsearch.data import QAExample
from rlsearch.loop_thread import LoopThread
from rlsearch.reward.judge import PROMPTS_DIR, Judge, JudgeCounters, JudgeError
from rlsearch.reward.qa import extract_answer, score_response, substring_match
from rlsearch.reward.registry import (
    JUDGED_SCORERS,
    RuleScorer,
    ScorerError,
    check_scorer_name,
    get_scorer,
    scorer_name_for,
)
from rlsearch.reward.rubric import dr_tulu_rubric_score, rubric_reward, rubric_terms, weighted_rubric_mean
from rlsearch.reward.rubric_generator import RubricGenerator
from rlsearch.reward.rubric_step import RubricStepStats, evolve_question, groups_by_question
from rlsearch.trajectory import RubricScore

if TYPE_CHECKING:
    from rlsearch.data import Rubric
    from rlsearch.reward.evolving import RubricBuffer
    from rlsearch.trajectory import Trajectory

RUBRIC_SCALE = 2.0  # the rubric prompt asks for 0, 1 or 2 per criterion; a bare number is read on this scale


class RewardScorer:
    """Scores trajectories under one RewardConfig; owns the judge client and its event loop (made when needed)."""

    def __init__(self, config: RewardConfig) -> None:
        self.config = config
        self._judge: Judge | None = None
        self._loop: LoopThread | None = None
        self._judge_prompt: PromptFile | None = None
        self._rubric_prompt: PromptFile | None = None
        self._generator: RubricGenerator | None = None  # reward.rubric.evolve.enabled

    def check(self, examples: Sequence[QAExample]) -> None:
        """The start-up check: every scorer named in `reward.scorers` is known, every row has a known scorer
        (`ScorerError` naming the key, or the row's file:line), and the judge's settings, key and prompt files are
        usable when a row needs the judge, and the rubric generator's too with reward.rubric.evolve (`ConfigError`)."""
        for source, name in self.config.scorers.items():
            try:
                check_scorer_name(name)
            except ScorerError as error:
                raise ScorerError(f"'reward.scorers.{source}': {error}") from None
        if set(self._scorer_names(examples)) & set(JUDGED_SCORERS):
            self._start_judge()

    def score(self, trajectories: Sequence[Trajectory], examples: Sequence[QAExample],
              rubrics: RubricBuffer | None = None, step: int = 0) -> dict[str, float]:
        """Set each trajectory's reward and scores (em, f1, substring_em, has_answer; correct for the judge;
        rubric, format, citation, search for rubrics, and the score per rubric in ``rubric_scores``).
        ``examples[i]`` is the row of ``trajectories[i]``. Returns reward/judged, reward/judge_requests,
        reward/judge_cache_hits, reward/judge_failures and reward/judge_failovers. With ``rubrics`` (training step
        ``step`` under reward.rubric.evolve) the rubric scorer's rows evolve their question's rubrics in it
        (`evolve_question`), and the reward/rubrics_* stats come too."""
        if len(trajectories) != len(examples):
            raise ValueError(f"{len(trajectories)} trajectories but {len(examples)} examples; give one per trajectory")
        names = self._scorer_names(examples)  # every row's scorer is known before anything is scored
        judged = []
        for trajectory, example, name in zip(trajectories, examples, names, strict=True):
            _score_by_rule(trajectory, example, score_response if name in JUDGED_SCORERS else get_scorer(name),
                           self.config)
            # a failed agent is not trained anyway, and a reward the agent returned replaces the scorer's
            if name in JUDGED_SCORERS and not trajectory.failed and trajectory.agent_reward is None:
                judged.append((trajectory, example, name))
        counters = JudgeCounters()
        failures = failovers = 0
        evolving = rubrics is not None and self.config.rubric.evolve.enabled
        stats = RubricStepStats() if evolving else None
        if judged:
            loop = self._start_judge()
            failovers_before = self._judge.endpoints.failovers
            failures = loop.run(self._judge_all(judged, counters, rubrics if evolving else None, step, stats))
            failovers = self._judge.endpoints.failovers - failovers_before
        return {
            **(stats.metrics() if stats else {}),
            "reward/judged": float(len(judged)), "reward/judge_requests": float(counters.requests),
            "reward/judge_cache_hits": float(counters.cache_hits), "reward/judge_failures": float(failures),
            # requests that moved on from a failed judge endpoint to the next (reward.judge.endpoints)
            "reward/judge_failovers": float(failovers),
        }

    def close(self) -> None:
        if self._loop is not None:
            self._loop.run(self._judge.close())
            if self._generator is not None:
                self._loop.run(self._generator.close())
            self._loop.stop()
            self._loop = self._judge = self._generator = None

    def _scorer_names(self, examples: Sequence[QAExample]) -> list[str]:
        names, checked = [], set()
        for example in examples:
            where = example.location or f"row {example.id!r}"
            try:
                name = scorer_name_for(example.data_source, example.scorer, self.config.scorers)
                if name not in checked:
                    check_scorer_name(name)
                    checked.add(name)
            except ScorerError as error:
                raise ScorerError(f"{where}: {error}") from None
            if name == "rubric" and not example.rubrics:
                raise ScorerError(f"{where}: the rubric scorer needs the row's 'rubrics' ([{{\"text\", \"weight\"}}])")
            names.append(name)
        return names

    def _start_judge(self) -> LoopThread:
        if self._loop is None:
            judge = self.config.judge
            self._judge_prompt = PromptFile.load(
                judge.prompt_file, PROMPTS_DIR / "judge.txt", ("question", "golden_answers", "response"),
                "reward.judge.prompt_file")
            self._rubric_prompt = PromptFile.load(
                judge.rubric_prompt_file, PROMPTS_DIR / "rubric.txt", ("question", "response", "rubric"),
                "reward.judge.rubric_prompt_file")
            self._judge = Judge(judge)
            if self.config.rubric.evolve.enabled:  # its prompt file and endpoints checked at start-up
                self._generator = RubricGenerator(self.config)
            self._loop = LoopThread("rlsearch-judge")
        return self._loop

    async def _judge_all(self, judged: list[tuple[Trajectory, QAExample, str]], counters: JudgeCounters,
                         rubrics: RubricBuffer | None, step: int, stats: RubricStepStats | None) -> int:
        """Judge every trajectory of `judged`; returns how many the judge failed."""
        evolving = [(trajectory, example) for trajectory, example, name in judged
                    if rubrics is not None and name == "rubric"]
        jobs = [self._judge_one(trajectory, example, name, counters) for trajectory, example, name in judged
                if rubrics is None or name != "rubric"]
        results = await asyncio.gather(*jobs)
        example_of = {example.id: example for _, example in evolving}

        def judge(example: QAExample):
            return lambda trajectory, scoring: self._judge_one(trajectory, example, "rubric", counters, scoring)

        failures = await asyncio.gather(*(
            evolve_question(rubrics, example_of[key], groups, step, self._generator, judge(example_of[key]), stats)
            for key, groups in groups_by_question(evolving).items()))
        return sum(result is None for result in results) + sum(failures)

    async def _judge_one(self, trajectory: Trajectory, example: QAExample, name: str, counters: JudgeCounters,
                         rubrics: Sequence[Rubric] | None = None) -> list[float] | None:
        """Judge one trajectory (on ``rubrics`` with DR Tulu's score, when given; else on its row's); its score per
        rubric (none for the judge scorer), or None when the judge failed it (it is then marked failed)."""
        text = _response_text(trajectory)
        try:
            if name == "judge":
                await self._judge_answer(trajectory, example, text, counters)
                return []
            return await self._judge_rubrics(trajectory, example, text, counters, rubrics)
        except JudgeError as error:
            trajectory.failed = f"judge: {error}"
            trajectory.reward = 0.0  # never trained (failed); a number only so that step means stay finite
            return None

    async def _judge_answer(self, trajectory: Trajectory, example: QAExample, text: str,
                            counters: JudgeCounters) -> None:
        answer = extract_answer(text)
        if answer is None:  # nothing to judge: wrong, as with em (reward 0)
            trajectory.scores["correct"] = 0.0
            return
        prompt = self._judge_prompt.render(
            question=example.question, golden_answers="; ".join(example.golden_answers), response=answer)
        correct = float(await self._judge.score(prompt, counters) >= 0.5)
        trajectory.scores["correct"] = correct
        trajectory.reward = (1.0 if correct else self.config.format_score) + _search_term(trajectory, self.config)

    async def _judge_rubrics(self, trajectory: Trajectory, example: QAExample, text: str, counters: JudgeCounters,
                             evolving: Sequence[Rubric] | None) -> list[float]:
        rubrics, combine = (example.rubrics, weighted_rubric_mean) if evolving is None else (
            evolving, dr_tulu_rubric_score)
        response = extract_answer(text) or text
        prompts = [self._rubric_prompt.render(question=example.question, response=response, rubric=rubric.text)
                   for rubric in rubrics]
        results = await asyncio.gather(*(self._judge.score(prompt, counters, scale=RUBRIC_SCALE)
                                         for prompt in prompts), return_exceptions=True)
        for index, result in enumerate(results):
            if isinstance(result, JudgeError):
                raise JudgeError(f"rubric {index}: {result}") from result
            if isinstance(result, BaseException):
                raise result
        mean = combine(rubrics, results)
        terms = rubric_terms(text, trajectory, self.config.rubric)
        trajectory.scores.update(rubric=mean, **terms)
        trajectory.rubric_scores = [RubricScore(rubric.text, rubric.weight, score)
                                    for rubric, score in zip(rubrics, results, strict=True)]
        trajectory.reward = rubric_reward(mean, terms, self.config.rubric)
        return results


def _response_text(trajectory: Trajectory) -> str:
    """What is scored: the model's text, or a user agent's returned answer as an answer block."""
    if trajectory.agent_answer is None:
        return trajectory.model_text
    return f"<answer>{trajectory.agent_answer}</answer>"


def _score_by_rule(trajectory: Trajectory, example: QAExample, rule: RuleScorer, config: RewardConfig) -> None:
    text = _response_text(trajectory)
    result = rule(text, example.golden_answers, config.format_score)
    trajectory.scores = {
        "em": result.em, "f1": result.f1,
        "substring_em": substring_match(extract_answer(text) or "", example.golden_answers),
        "has_answer": float(result.has_answer),
        "valid_search": float(bool(trajectory.tool_calls) and trajectory.num_invalid_calls == 0),
    }
    if trajectory.agent_reward is not None:
        trajectory.reward = trajectory.agent_reward
    else:
        trajectory.reward = result.reward + _search_term(trajectory, config)


def _search_term(trajectory: Trajectory, config: RewardConfig) -> float:
    """reward.search_score when the trajectory called a tool and made no invalid call (scores["valid_search"])."""
    return config.search_score * trajectory.scores["valid_search"]


_SCORERS: dict[str, RewardScorer] = {}


def reward_scorer(config: RewardConfig) -> RewardScorer:
    """The process's scorer of ``config`` (one judge client, cache and rate limit per config across calls)."""
    key = json.dumps(dataclasses.asdict(config), sort_keys=True)
    if key not in _SCORERS:
        _SCORERS[key] = RewardScorer(config)
    return _SCORERS[key]


def check_scorers(examples: Sequence[QAExample], config: RewardConfig) -> None:
    """Start-up check of ``examples`` against ``config`` (see `RewardScorer.check`)."""
    reward_scorer(config).check(examples)


def score_trajectories(
    trajectories: Sequence[Trajectory], examples: Sequence[QAExample], config: RewardConfig,
    rubrics: RubricBuffer | None = None, step: int = 0,
) -> dict[str, float]:
    """Score ``trajectories`` (``examples[i]`` is the row of ``trajectories[i]``; ``rubrics``: the run's evolving
    rubrics at training step ``step``, see `RewardScorer.score`); returns the reward/judge_* (and rubrics_*) stats."""
    return reward_scorer(config).score(trajectories, examples, rubrics, step)
