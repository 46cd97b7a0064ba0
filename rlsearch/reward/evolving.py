"""Evolving rubrics (DR Tulu's RLER): a buffer of rubrics per question that grows with the policy. Plain data, no I/O.

Each question keeps its persistent rubrics (the dataset's, never pruned), its active evolving ones (added by the
generator, scored every step with the persistent ones) and its inactive ones (pruned, never reactivated). After a
step's scoring, `RubricBuffer.filter` deactivates every active rubric whose scores over the group have zero std (it
no longer tells the group's answers apart), then keeps at most ``max_active`` active, the largest std first.
`to_state` / `from_state` carry the buffer in a checkpoint as JSON.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rlsearch.data import Rubric

GENERATED_WEIGHTS = {"positive": 1.0, "negative": -1.0}  # DR Tulu's weights of generated rubrics
_SPACES = re.compile(r"\s+")


@dataclass
class EvolvingRubric:
    text: str
    weight: float  # +1 a positive rubric, -1 a negative one (a dataset rubric kept non-persistent: its own weight)
    title: str = ""
    origin: str = "generated"  # generated | dataset (use_static_rubrics_as_persistent_rubrics off)
    added_step: int = 0
    std: float | None = None  # of its scores over the group, the last step it was scored
    removed_step: int | None = None  # the step it became inactive

    @property
    def rubric(self) -> Rubric:
        return Rubric(self.text, self.weight)


@dataclass
class QuestionRubrics:
    persistent: list[Rubric] = field(default_factory=list)
    active: list[EvolvingRubric] = field(default_factory=list)
    inactive: list[EvolvingRubric] = field(default_factory=list)

    def scoring_rubrics(self) -> list[Rubric]:
        """What this step's answers are judged on: the persistent rubrics, then the active ones."""
        return [*self.persistent, *(rubric.rubric for rubric in self.active)]

    def known(self) -> set[str]:
        return {_normalised(rubric.text) for rubric in [*self.persistent, *self.active, *self.inactive]}


@dataclass(frozen=True)
class FilterResult:
    deactivated_zero_std: int  # active rubrics that scored the whole group alike
    deactivated_over_cap: int  # active rubrics beyond max_active with the smallest std

    @property
    def deactivated(self) -> int:
        return self.deactivated_zero_std + self.deactivated_over_cap


class RubricBuffer:
    """The rubrics of every question seen, by a key the caller chooses (the row's id). ``persistent=False`` makes a
    question's dataset rubrics active evolving ones (DR Tulu's use_static_rubrics_as_persistent_rubrics off), so the
    filter can prune them too."""

    def __init__(self, max_active: int = 5, persistent: bool = True) -> None:
        if max_active < 1:
            raise ValueError(f"max_active must be >= 1; got {max_active}")
        self.max_active = max_active
        self.persistent = persistent
        self.questions: dict[str, QuestionRubrics] = {}

    def question(self, key: str, dataset_rubrics: Sequence[Rubric] = ()) -> QuestionRubrics:
        """The rubrics of ``key``, made from ``dataset_rubrics`` the first time it is asked for."""
        if key not in self.questions:
            if self.persistent:
                self.questions[key] = QuestionRubrics(persistent=list(dataset_rubrics))
            else:
                self.questions[key] = QuestionRubrics(active=[
                    EvolvingRubric(rubric.text, rubric.weight, origin="dataset") for rubric in dataset_rubrics])
        return self.questions[key]

    def add(self, key: str, generated: Sequence[EvolvingRubric], step: int) -> int:
        """Add ``generated`` to the active rubrics of ``key`` (made before with `question`), stamped with ``step``;
        a rubric whose text (case and spacing aside) the question already has, active, inactive or persistent, is
        skipped. Returns how many were added."""
        rubrics = self.questions[key]
        known = rubrics.known()
        added = 0
        for rubric in generated:
            if _normalised(rubric.text) in known:
                continue
            known.add(_normalised(rubric.text))
            rubrics.active.append(dataclasses.replace(rubric, added_step=step, std=None, removed_step=None))
            added += 1
        return added

    def filter(self, key: str, scores: Mapping[str, Sequence[float]], step: int) -> FilterResult:
        """After scoring: ``scores[text]`` holds an active rubric's score (0, 0.5 or 1) for each answer of the group.
        An active rubric with at least two scores and zero std becomes inactive; then, while more than max_active
        are active, the one with the smallest std (the oldest among equals) does. A rubric with fewer than two
        scores (its answers failed) has no std this step and stays. Persistent rubrics are never touched."""
        rubrics = self.questions[key]
        for rubric in rubrics.active:
            values = scores.get(rubric.text, ())
            if len(values) >= 2:
                rubric.std = statistics.pstdev(values)
        scored_now = {rubric.text for rubric in rubrics.active if len(scores.get(rubric.text, ())) >= 2}
        flat = [rubric for rubric in rubrics.active if rubric.text in scored_now and rubric.std == 0]
        self._deactivate(rubrics, flat, step)
        over = len(rubrics.active) - self.max_active
        candidates = [rubric for rubric in rubrics.active if rubric.text in scored_now]
        pruned = sorted(candidates, key=lambda rubric: rubric.std)[:max(over, 0)]
        self._deactivate(rubrics, pruned, step)
        return FilterResult(len(flat), len(pruned))

    @staticmethod
    def _deactivate(rubrics: QuestionRubrics, leaving: list[EvolvingRubric], step: int) -> None:
        for rubric in leaving:
            rubric.removed_step = step
            rubrics.inactive.append(rubric)
        rubrics.active = [rubric for rubric in rubrics.active if all(rubric is not gone for gone in leaving)]

    def to_state(self) -> dict:
        """The buffer as JSON-serialisable data (saved with a checkpoint); `from_state` restores it exactly."""
        return {"questions": {key: {
            "persistent": [dataclasses.asdict(rubric) for rubric in rubrics.persistent],
            "active": [dataclasses.asdict(rubric) for rubric in rubrics.active],
            "inactive": [dataclasses.asdict(rubric) for rubric in rubrics.inactive],
        } for key, rubrics in self.questions.items()}}

    @classmethod
    def from_state(cls, state: Mapping, max_active: int = 5, persistent: bool = True) -> RubricBuffer:
        buffer = cls(max_active, persistent)
        for key, rubrics in state["questions"].items():
            buffer.questions[key] = QuestionRubrics(
                persistent=[Rubric(**rubric) for rubric in rubrics["persistent"]],
                active=[EvolvingRubric(**rubric) for rubric in rubrics["active"]],
                inactive=[EvolvingRubric(**rubric) for rubric in rubrics["inactive"]],
            )
        return buffer


def _normalised(text: str) -> str:
    return _SPACES.sub(" ", text).strip().casefold()
