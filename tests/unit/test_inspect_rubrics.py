"""`rlsearch inspect`'s HTML page with evolving rubrics: a question's rubric history from the newest checkpoint's
rubric_buffer.json (when each rubric came, its std, when it was retired) and each trajectory's score per rubric from
its record, on a small synthetic run dir."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from rlsearch.checkpoint.layout import RUBRIC_BUFFER
from rlsearch.data import Rubric
from rlsearch.inspection import open_index, update_index, write_page
from rlsearch.reward.evolving import EvolvingRubric, RubricBuffer
from rlsearch.trajectory import RubricScore, Trajectory, Turn

PERSISTENT = Rubric("Cites a primary source", 2.0)
CAUSE, DATE, POLITE = "Names the 1702 flood as the cause", "Dates the collapse to 1800", "Is polite"
ANSWERS = {0: "<answer>The 1702 flood.</answer>", 1: "<answer>It collapsed in 1800.</answer>"}
# (persistent, cause, date) scores of each sample at step 2
SCORES = {0: (0.5, 1.0, 0.0), 1: (0.5, 0.0, 1.0)}


def buffer_after_step_2() -> RubricBuffer:
    """Step 1 adds the cause and the date; step 2 adds "Is polite", which both answers meet (retired)."""
    buffer = RubricBuffer()
    buffer.question("velmora", [PERSISTENT])
    buffer.add("velmora", [EvolvingRubric(CAUSE, 1.0), EvolvingRubric(DATE, -1.0)], step=1)
    buffer.filter("velmora", {CAUSE: [1.0, 0.0], DATE: [0.0, 1.0]}, step=1)
    buffer.add("velmora", [EvolvingRubric(POLITE, 1.0)], step=2)
    buffer.filter("velmora", {CAUSE: [1.0, 0.0], DATE: [0.0, 1.0], POLITE: [1.0, 1.0]}, step=2)
    return buffer


def record(sample: int) -> dict:
    rubrics = [PERSISTENT, Rubric(CAUSE, 1.0), Rubric(DATE, -1.0)]
    scores = [RubricScore(rubric.text, rubric.weight, score) for rubric, score in zip(rubrics, SCORES[sample])]
    trajectory = Trajectory("velmora", 0, sample, [1, 2], response_ids=[3, 4, 5], loss_mask=[1, 1, 1],
                            rollout_logprobs=[-0.1] * 3, finish_reason="answer", rubric_scores=scores,
                            turns=[Turn(ANSWERS[sample], 3, "answer")], reward=0.5, scores={"rubric": 0.5})
    return {**trajectory.to_json(), "step": 2, "question": "Why did the Velmora guild collapse?",
            "golden_answers": [], "staleness": 0}


def make_run(run: Path) -> Path:
    (run / "trajectories").mkdir(parents=True)
    (run / "trajectories" / "step_000002.jsonl").write_text(
        "".join(json.dumps(record(sample)) + "\n" for sample in (0, 1)))
    for step, buffer in ((1, RubricBuffer()), (2, buffer_after_step_2())):  # the newest checkpoint's is shown
        (run / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
        (run / "checkpoints" / f"step_{step:06d}" / RUBRIC_BUFFER).write_text(json.dumps(buffer.to_state()))
    return run


def page_of(run: Path) -> tuple[str, list[str]]:
    update_index(run)
    db = open_index(run)
    try:
        written = write_page(db, run, "train", 2)
    finally:
        db.close()
    return written.path.read_text(encoding="utf-8"), written.notes


def test_the_page_shows_the_rubric_history_and_each_answers_scores(tmp_path: Path) -> None:
    html, notes = page_of(make_run(tmp_path / "run"))
    assert f"rubric history from {tmp_path / 'run' / 'checkpoints' / 'step_000002' / RUBRIC_BUFFER}" in notes[-1]
    assert "<h2>rubrics of velmora (checkpoint step 2)</h2>" in html
    # state, weight, rubric, added at step, last std, retired at step
    assert ("<tr><td>persistent</td><td>2</td><td>Cites a primary source</td><td>-</td><td>-</td><td>-</td></tr>"
            "<tr><td>active</td><td>1</td><td>Names the 1702 flood as the cause</td><td>1</td><td>0.500</td>"
            "<td>-</td></tr>"
            "<tr><td>active</td><td>-1</td><td>Dates the collapse to 1800</td><td>1</td><td>0.500</td><td>-</td>"
            "</tr><tr><td>retired</td><td>1</td><td>Is polite</td><td>2</td><td>0.000</td><td>2</td></tr>") in html
    assert ("<li>step 1: added “Names the 1702 flood as the cause”; added “Dates the collapse to 1800”</li>"
            "<li>step 2: added “Is polite”; retired “Is polite”</li>") in html
    # each trajectory's scores: 2 * 0.5 + 1 * 1 - 1 * 0 = 2 and 2 * 0.5 + 0 - 1 * 1 = 0
    first, second = html.split('id="traj-1"')[1].split('id="traj-2"')
    assert ("<summary>score per rubric (weighted sum 2)</summary>" in first
            and "<summary>score per rubric (weighted sum 0)</summary>" in second)
    assert ("<tr><td>0.5</td><td>2</td><td>Cites a primary source</td></tr><tr><td>1</td><td>1</td><td>Names the "
            "1702 flood as the cause</td></tr><tr><td>0</td><td>-1</td><td>Dates the collapse to 1800</td></tr>"
            in first)
    assert "<tr><td>0</td><td>1</td><td>Names the 1702 flood as the cause</td></tr>" in second


def test_without_a_rubric_buffer_or_scores_the_page_has_no_rubrics(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    for step in (1, 2):
        (run / "checkpoints" / f"step_{step:06d}" / RUBRIC_BUFFER).unlink()
    lines = (run / "trajectories" / "step_000002.jsonl").read_text().splitlines()
    plain = [json.dumps({**json.loads(line), "rubric_scores": []}) for line in lines]
    (run / "trajectories" / "step_000002.jsonl").write_text("".join(line + "\n" for line in plain))
    html, notes = page_of(run)
    assert "rubrics of" not in html and "score per rubric" not in html and CAUSE not in html
    assert not any("rubric" in note for note in notes)


def test_a_damaged_rubric_buffer_is_a_note_not_a_failure(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    state = buffer_after_step_2().to_state()
    state["questions"]["velmora"]["active"][0] = {**dataclasses.asdict(EvolvingRubric(CAUSE, 1.0)), "colour": "red"}
    (run / "checkpoints" / "step_000002" / RUBRIC_BUFFER).write_text(json.dumps(state))
    html, notes = page_of(run)
    assert "the rubric history is left out:" in notes[-1] and "TypeError" in notes[-1]
    assert "rubrics of velmora" not in html
    assert "<summary>score per rubric (weighted sum 2)</summary>" in html  # the records' scores still show
