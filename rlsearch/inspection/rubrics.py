"""The rubrics on the HTML page: each question's rubric history (reward.rubric.evolve) as the newest checkpoint's
rubric_buffer.json holds it (when each rubric came, its last std, when it was retired), and a trajectory's score per
rubric from its record (``rubric_scores``)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint.layout import RUBRIC_BUFFER

if TYPE_CHECKING:
    from ..reward.evolving import QuestionRubrics

_STEP_DIR = re.compile(r"step_(\d+)")


@dataclass(frozen=True)
class RubricHistory:
    path: Path  # the rubric_buffer.json it was read from
    step: int  # of its checkpoint
    questions: dict[str, QuestionRubrics]


def load_rubric_history(run_dir: Path) -> tuple[RubricHistory | None, str]:
    """The newest checkpoint's rubric buffer, and the page's note about it ("" when the run has none to show)."""
    found = sorted((int(match.group(1)), path) for path in run_dir.glob(f"checkpoints/step_*/{RUBRIC_BUFFER}")
                   if (match := _STEP_DIR.fullmatch(path.parent.name)))
    if not found:
        return None, ""
    step, path = found[-1]
    from ..reward.evolving import RubricBuffer  # here: the reward package loads a judge client, slow for `-h`

    try:
        buffer = RubricBuffer.from_state(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError) as error:
        return None, f"the rubric history is left out: {path} is unreadable ({type(error).__name__}: {error})"
    return RubricHistory(path, step, buffer.questions), (
        f"rubric history from {path}: the evolving rubrics as of checkpoint step {step}")


def history_html(history: RubricHistory, example_ids: Iterable[str]) -> str:
    """A section per question of the page that the buffer holds: its rubrics in a table and, step by step, which
    came and which were retired."""
    sections = []
    for example_id in dict.fromkeys(example_ids):
        rubrics = history.questions.get(example_id)
        if rubrics is None:
            continue
        rows = [("persistent", f"{rubric.weight:g}", rubric.text, "-", "-", "-") for rubric in rubrics.persistent]
        evolving = sorted([*rubrics.active, *rubrics.inactive], key=lambda rubric: rubric.added_step)
        rows += [(("active" if rubric.removed_step is None else "retired") + _from_dataset(rubric.origin),
                  f"{rubric.weight:g}", rubric.text,
                  rubric.added_step, "-" if rubric.std is None else f"{rubric.std:.3f}",
                  "-" if rubric.removed_step is None else rubric.removed_step) for rubric in evolving]
        cells = "".join(
            "<tr>" + "".join(f"<td>{escape(str(value))}</td>" for value in row) + "</tr>" for row in rows)
        sections.append(
            f'<section class="rubrics" id="rubrics-{escape(example_id)}"><h2>rubrics of {escape(example_id)} '
            f"(checkpoint step {history.step})</h2>{_timeline(rubrics)}"
            '<table class="index"><tr><th>state</th><th>weight</th><th>rubric</th><th>added at step</th>'
            f"<th>last std</th><th>retired at step</th></tr>{cells}</table></section>\n")
    return "".join(sections)


def _from_dataset(origin: str) -> str:
    """The mark of a dataset rubric kept among the evolving ones (use_static_rubrics_as_persistent_rubrics off)."""
    return " (dataset)" if origin == "dataset" else ""


def _timeline(rubrics: QuestionRubrics) -> str:
    events: dict[int, list[str]] = {}
    for rubric in [*rubrics.active, *rubrics.inactive]:
        events.setdefault(rubric.added_step, []).append(f"added “{rubric.text}”")
        if rubric.removed_step is not None:
            events.setdefault(rubric.removed_step, []).append(f"retired “{rubric.text}”")
    items = "".join(f"<li>step {step}: {escape('; '.join(what))}</li>" for step, what in sorted(events.items()))
    return f'<ul class="calls">{items}</ul>' if items else ""


def scores_html(record: dict) -> str:
    """The trajectory's score per rubric, with the weighted sum they add to; empty when the record has none."""
    scores = record.get("rubric_scores") or []
    if not scores:
        return ""
    rows = "".join(f'<tr><td>{score["score"]:g}</td><td>{score["weight"]:g}</td><td>{escape(score["text"])}</td></tr>'
                   for score in scores)
    total = sum(score["weight"] * score["score"] for score in scores)
    return (f"<details open><summary>score per rubric (weighted sum {total:g})</summary>"
            f'<table class="index"><tr><th>score</th><th>weight</th><th>rubric</th></tr>{rows}</table></details>')
