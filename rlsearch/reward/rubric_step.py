"""A training step's evolving rubrics (DR Tulu's RLER, reward.rubric.evolve): for each prompt group the rubric scorer
scores, one generator call, its new rubrics added to the question's buffer, the group's answers judged on the
persistent and active rubrics (`dr_tulu_rubric_score`), then the buffer's std filter over the group. The judging
itself is the caller's (score.py's `RewardScorer`), passed in as ``judge``.

Groups of one question run in group order, one after another (a question drawn twice in a step sees the first
group's rubrics in the second), so a replayed step asks the same prompts and gets the same rewards."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlsearch.reward.rubric_generator import GeneratorCounters, RubricGenerator

if TYPE_CHECKING:
    from rlsearch.data import QAExample, Rubric
    from rlsearch.reward.evolving import RubricBuffer
    from rlsearch.trajectory import Trajectory

JudgeRubrics = Callable[["Trajectory", "Sequence[Rubric]"], Awaitable["list[float] | None"]]
"""(trajectory, rubrics) -> its score per rubric (0, 0.5 or 1), or None when the judge failed it"""


@dataclass
class RubricStepStats:
    generator: GeneratorCounters = field(default_factory=GeneratorCounters)
    generated: int = 0  # rubrics the generator returned
    activated: int = 0  # of them, those the buffer took (not a repeat of a rubric the question has)
    deactivated: int = 0  # active rubrics the std filter and the cap made inactive
    judge_calls: int = 0  # (answer, rubric) judgements asked
    active: list[int] = field(default_factory=list)  # active rubrics of each question scored, after its filter

    def metrics(self) -> dict[str, float]:
        return {
            "reward/rubrics_generated": float(self.generated),
            "reward/rubrics_activated": float(self.activated),
            "reward/rubrics_deactivated": float(self.deactivated),
            "reward/rubrics_active_per_question": statistics.fmean(self.active) if self.active else 0.0,
            "reward/rubrics_generator_calls": float(self.generator.calls),
            "reward/rubrics_generator_failures": float(self.generator.failures),
            "reward/rubrics_generator_requests": float(self.generator.requests.requests),
            "reward/rubrics_judge_calls": float(self.judge_calls),
        }


def groups_by_question(judged: Sequence[tuple[Trajectory, QAExample]]) -> dict[str, list[list[Trajectory]]]:
    """The trajectories to judge, by their row's id (the buffer's key), then by prompt group in group order."""
    by_group: dict[int, list[Trajectory]] = {}
    keys: dict[int, str] = {}
    for trajectory, example in judged:
        by_group.setdefault(trajectory.group_id, []).append(trajectory)
        keys[trajectory.group_id] = example.id
    questions: dict[str, list[list[Trajectory]]] = {}
    for group_id in sorted(by_group):
        questions.setdefault(keys[group_id], []).append(by_group[group_id])
    return questions


async def evolve_question(buffer: RubricBuffer, example: QAExample, groups: Sequence[Sequence[Trajectory]],
                          step: int, generator: RubricGenerator, judge: JudgeRubrics, stats: RubricStepStats) -> int:
    """Every group of ``example``'s question this step, in order; returns how many trajectories the judge failed."""
    failures = 0
    for group in groups:
        rubrics = buffer.question(example.id, example.rubrics)
        generated = await generator.generate(example.question, group, rubrics.scoring_rubrics(), stats.generator)
        if generated:  # None: a failed generation, counted; the group keeps its active rubrics
            stats.generated += len(generated)
            stats.activated += buffer.add(example.id, generated, step)
        persistent, active = len(rubrics.persistent), [rubric.text for rubric in rubrics.active]
        scoring = rubrics.scoring_rubrics()
        stats.judge_calls += len(scoring) * len(group)
        results = await asyncio.gather(*(judge(trajectory, scoring) for trajectory in group))
        scored = [scores for scores in results if scores is not None]
        failures += len(group) - len(scored)
        by_rubric = {text: [scores[persistent + index] for scores in scored] for index, text in enumerate(active)}
        stats.deactivated += buffer.filter(example.id, by_rubric, step).deactivated
    stats.active.append(len(buffer.questions[example.id].active))
    return failures
