"""`rlsearch inspect` as text: the queries' rows as aligned tables, the run's summary, the command itself."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from . import queries
from .index import EVAL, InspectError, open_index, update_index

SUMMARY_ROWS = 20  # rows of each summary table (the latest steps); --query NAME shows them all
MAX_TEXT = 48  # characters of a text cell (answers, questions)


class Query(NamedTuple):
    title: str
    rows: Callable[[sqlite3.Connection, str, int | None], list]


QUERIES: dict[str, Query] = {
    "overview": Query("Per step: trajectories, groups, mean reward, EM, share correct, mean tool and invalid calls, "
                      "failed trajectories", queries.overview),
    "uniform-groups": Query("Groups with no reward variance (every sample the same reward: no GRPO signal)",
                            queries.uniform_groups),
    "tool-errors": Query("Tool errors per step by tool and error kind (calls: that tool's calls in the step)",
                         queries.tool_errors),
    "no-search": Query("Answers found without searching (correct, no tool call)", queries.answers_without_search),
    "format-only": Query("Reward without a correct answer (reward > 0: format and search terms alone)",
                         queries.format_only_rewards),
    "staleness": Query("Staleness per step (weight versions between the trained policy and the oldest turn's)",
                       queries.staleness),
    "truncations": Query("Cuts per step by reason (response_budget, turn_tokens, max_turns, context_window, "
                         "tool_output, prompt)", queries.truncations),
}
QUERY_NAMES = ("question", *QUERIES)


def format_cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list):
        value = "; ".join(map(str, value))
    text = " ".join(str(value).split())  # one line
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT - 1] + "…"


def format_table(rows: Sequence[NamedTuple], max_rows: int | None = None, hint: str = "") -> str:
    """Aligned columns headed by the rows' field names; numbers right-aligned. Beyond `max_rows` only the last rows
    show, after a line saying how many were left out and `hint`."""
    if not rows:
        return "(none)"
    shown = rows if max_rows is None else rows[-max_rows:]
    cells = [list(rows[0]._fields)] + [[format_cell(value) for value in row] for row in shown]
    numeric = [any(isinstance(value, (int, float)) for value in column) for column in zip(*shown)]
    widths = [max(len(line[column]) for line in cells) for column in range(len(cells[0]))]
    lines = ["  ".join(cell.rjust(width) if is_number else cell.ljust(width)
                       for cell, width, is_number in zip(line, widths, numeric)).rstrip() for line in cells]
    if len(shown) < len(rows):
        lines.insert(1, f"… {len(rows) - len(shown)} earlier rows not shown{hint}")
    return "\n".join(lines)


def _section(title: str, body: str) -> str:
    return f"{title}\n{body}\n"


def query_report(db: sqlite3.Connection, name: str, source: str, step: int | None = None,
                 question: str | None = None) -> str:
    """One query's table (`name` in QUERY_NAMES; `question` for "question")."""
    if name == "question":
        if not question:
            raise InspectError("--query question needs --question ID_OR_TEXT (an example_id, or text of the question)")
        return question_report(db, question, source, step)
    query = QUERIES[name]
    return _section(query.title, format_table(query.rows(db, source, step)))


def question_report(db: sqlite3.Connection, id_or_text: str, source: str, step: int | None = None) -> str:
    matches = queries.find_questions(db, id_or_text, source)
    if not matches:
        raise InspectError(f"no {source} trajectory has example_id '{id_or_text}' or a question containing it")
    sections = []
    for match in matches:
        title = (f"{match.example_id}: {match.question}\ngolden answers: {'; '.join(match.golden_answers)}\n"
                 f"its samples across steps ({match.trajectories} trajectories):")
        history = queries.question_history(db, match.example_id, source, step)
        sections.append(_section(title, format_table(history)))
    return "\n".join(sections)


def summary_report(db: sqlite3.Connection, source: str, step: int | None = None) -> str:
    """The overview, then the headline of each query."""
    def table(name: str, rows: list) -> str:
        return format_table(rows, SUMMARY_ROWS, f" (--query {name} shows all)")

    per_step = queries.overview(db, source, step)
    no_search = queries.answers_without_search(db, source, step)
    format_only = queries.format_only_rewards(db, source, step)
    total = sum(row.trajectories for row in per_step)
    examples = db.execute("SELECT example_id FROM trajectories WHERE source = ? LIMIT 1", (source,)).fetchone()
    sections = [
        _section(QUERIES["overview"].title, table("overview", per_step)),
        _section("Groups with no reward variance per step (--query uniform-groups lists them)",
                 format_table(queries.uniform_groups_per_step(db, source, step), SUMMARY_ROWS)),
        _section("Tool errors by tool and error kind, all steps (--query tool-errors: per step)",
                 format_table(queries.tool_errors(db, source, step, by_step=False))),
        _section(f"Answers found without searching: {len(no_search)} of {total} trajectories "
                 "(--query no-search lists them)", table("no-search", no_search)),
        _section(f"Reward without a correct answer: {len(format_only)} of {total} trajectories "
                 "(--query format-only lists them)", table("format-only", format_only)),
        _section(QUERIES["staleness"].title, table("staleness", queries.staleness(db, source, step))),
        _section(QUERIES["truncations"].title, table("truncations", queries.truncations(db, source, step))),
        f"One question across steps: --question ID_OR_TEXT (e.g. --question {examples[0]})\n",
    ]
    return "\n".join(sections)


def inspect_command(run_dir: str | Path, query: str | None = None, question: str | None = None,
                    step: int | None = None, eval_trajectories: bool = False, html: bool = False,
                    out: str | Path | None = None) -> str:
    """`rlsearch inspect`: update the index, then the summary, one query's table, or (html) the HTML page."""
    update = update_index(run_dir)
    db = open_index(run_dir)
    try:
        source = EVAL if eval_trajectories else queries.default_source(db)
        known_steps = queries.steps(db, source)
        if not known_steps:
            raise InspectError(f"{run_dir} holds no {source} trajectories")
        if step is not None and step not in known_steps:
            raise InspectError(f"no {source} trajectories at step {step}; {_describe_steps(known_steps)}")
        heading = f"{update.describe()}\n{source} trajectories, {_describe_steps(known_steps)}\n"
        if html:
            from .page import write_page

            return heading + write_page(db, Path(run_dir), source, step, out).describe()
        if question and query not in (None, "question"):
            raise InspectError(f"--question goes alone (or with --query question), not with --query {query}")
        if question:
            return heading + "\n" + question_report(db, question, source, step)
        if query is None:
            return heading + "\n" + summary_report(db, source, step)
        return heading + "\n" + query_report(db, query, source, step, question)
    finally:
        db.close()


def _describe_steps(steps: list[int]) -> str:
    if len(steps) == 1:
        return f"step {steps[0]}"
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"steps {steps[0]}-{steps[-1]}"
    return f"steps {', '.join(map(str, steps))}"
