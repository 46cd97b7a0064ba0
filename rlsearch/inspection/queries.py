"""The questions researchers ask of a run's trajectories, each a function of the index returning rows.

Every query takes the index connection, `source` (train or eval trajectories) and optionally one `step`; none
writes. Failed trajectories (a user agent or the judge failed) carry no reward: reward figures leave them out, as
training does.
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from typing import NamedTuple

from .index import EVAL, TRAIN


class StepOverview(NamedTuple):
    step: int
    trajectories: int
    groups: int
    mean_reward: float | None  # over the trajectories that did not fail
    em: float | None  # mean EM over the trajectories scored by EM
    correct: float  # share judged correct (EM > 0 without a judge)
    tool_calls: float  # mean per trajectory
    invalid_calls: float  # mean per trajectory
    failed: int


class QuestionMatch(NamedTuple):
    example_id: str
    question: str
    golden_answers: list[str]
    trajectories: int


class QuestionSample(NamedTuple):
    step: int
    group_id: int
    sample_index: int
    reward: float
    em: float | None
    tool_calls: int
    finish_reason: str
    answer: str | None


class UniformGroupsAtStep(NamedTuple):
    step: int
    groups: int
    uniform_groups: int  # every sample got the same reward: no learning signal in GRPO
    share: float


class UniformGroup(NamedTuple):
    step: int
    group_id: int
    example_id: str
    samples: int
    reward: float  # the reward every sample got


class ToolErrorCount(NamedTuple):
    step: int | str  # "all": over every step
    tool: str  # INVALID_CALL_TOOL for a turn that wrote no well-formed call
    error_kind: str
    errors: int
    calls: int  # every call of that tool (or invalid call) in that step, failed or not


class TrajectoryRow(NamedTuple):
    step: int
    example_id: str
    group_id: int
    sample_index: int
    reward: float
    em: float | None
    tool_calls: int
    answer: str | None
    golden_answers: str


class StalenessCount(NamedTuple):
    step: int
    staleness: int  # weight versions between the trained policy and the oldest turn's
    trajectories: int
    share: float  # of the step's trajectories that record staleness


class TruncationCount(NamedTuple):
    step: int
    reason: str  # rlsearch.config.TRUNCATION_REASONS
    cuts: int
    trajectories: int  # cut for this reason at least once
    share: float  # of the step's trajectories


def _where(source: str, step: int | None, table: str = "trajectories") -> tuple[str, list]:
    """The WHERE clause selecting `source` (and `step`) in `table`, and its parameters."""
    if step is None:
        return f"{table}.source = ?", [source]
    return f"{table}.source = ? AND {table}.step = ?", [source, step]


def default_source(db: sqlite3.Connection) -> str:
    """train when the index holds training trajectories, else eval."""
    has_train = db.execute("SELECT 1 FROM trajectories WHERE source = ? LIMIT 1", (TRAIN,)).fetchone()
    return TRAIN if has_train else EVAL


def steps(db: sqlite3.Connection, source: str) -> list[int]:
    return [step for (step,) in db.execute(
        "SELECT DISTINCT step FROM trajectories WHERE source = ? ORDER BY step", (source,))]


def overview(db: sqlite3.Connection, source: str, step: int | None = None) -> list[StepOverview]:
    """Per step: trajectories, GRPO groups, mean reward, EM, share correct, tool and invalid calls, failures."""
    where, parameters = _where(source, step)
    rows = db.execute(f"""
        SELECT step, COUNT(*), COUNT(DISTINCT group_id || '/' || example_id),
               AVG(CASE WHEN failed = '' THEN reward END), AVG(em), AVG(correct),
               AVG(num_tool_calls), AVG(num_invalid_calls), SUM(failed != '')
        FROM trajectories WHERE {where} GROUP BY step ORDER BY step""", parameters)
    return [StepOverview(*row) for row in rows]


def find_questions(db: sqlite3.Connection, id_or_text: str, source: str) -> list[QuestionMatch]:
    """The questions whose example_id is `id_or_text`, or else whose text contains it (case-insensitive)."""
    query = """
        SELECT example_id, question, golden_answers, COUNT(*) FROM trajectories
        WHERE source = ? AND {condition} GROUP BY example_id ORDER BY example_id"""
    rows = db.execute(query.format(condition="example_id = ?"), (source, id_or_text)).fetchall()
    if not rows:
        pattern = "%" + id_or_text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        rows = db.execute(query.format(condition="question LIKE ? ESCAPE '\\'"), (source, pattern)).fetchall()
    return [QuestionMatch(example_id, question, json.loads(golden), count)
            for example_id, question, golden, count in rows]


def question_history(db: sqlite3.Connection, example_id: str, source: str,
                     step: int | None = None) -> list[QuestionSample]:
    """Every sample of one question across steps: reward, EM, tool calls, how it ended, its answer."""
    where, parameters = _where(source, step)
    rows = db.execute(f"""
        SELECT step, group_id, sample_index, reward, em, num_tool_calls, finish_reason, answer
        FROM trajectories WHERE {where} AND example_id = ?
        ORDER BY step, group_id, sample_index""", [*parameters, example_id])
    return [QuestionSample(*row) for row in rows]


_GROUPS = """
    SELECT step, group_id, example_id, COUNT(*) AS samples, MIN(reward) AS low, MAX(reward) AS high
    FROM trajectories WHERE {where} AND failed = '' GROUP BY step, group_id, example_id"""


def uniform_groups_per_step(db: sqlite3.Connection, source: str,
                            step: int | None = None) -> list[UniformGroupsAtStep]:
    """Per step: groups (of the samples that did not fail) and how many got one reward for every sample."""
    where, parameters = _where(source, step)
    rows = db.execute(f"""
        SELECT step, COUNT(*), SUM(low = high) FROM ({_GROUPS.format(where=where)})
        GROUP BY step ORDER BY step""", parameters)
    return [UniformGroupsAtStep(step, groups, uniform, uniform / groups) for step, groups, uniform in rows]


def uniform_groups(db: sqlite3.Connection, source: str, step: int | None = None) -> list[UniformGroup]:
    """The groups whose samples all got the same reward."""
    where, parameters = _where(source, step)
    rows = db.execute(f"""
        SELECT step, group_id, example_id, samples, low FROM ({_GROUPS.format(where=where)})
        WHERE low = high ORDER BY step, group_id""", parameters)
    return [UniformGroup(*row) for row in rows]


def tool_errors(db: sqlite3.Connection, source: str, step: int | None = None,
                by_step: bool = True) -> list[ToolErrorCount]:
    """Error observations by tool and error kind (invalid calls under INVALID_CALL_TOOL), per step or in total,
    with the tool's calls beside them."""
    where, parameters = _where(source, step, "calls")
    step_column = "step" if by_step else "'all'"
    rows = db.execute(f"""
        WITH counted AS (SELECT {step_column} AS at, tool, error_kind FROM calls WHERE {where}),
             per_tool AS (SELECT at, tool, COUNT(*) AS calls FROM counted GROUP BY at, tool)
        SELECT counted.at, counted.tool, counted.error_kind, COUNT(*), per_tool.calls
        FROM counted JOIN per_tool ON per_tool.tool = counted.tool AND per_tool.at = counted.at
        WHERE counted.error_kind IS NOT NULL
        GROUP BY counted.at, counted.tool, counted.error_kind
        ORDER BY counted.at, COUNT(*) DESC, counted.tool, counted.error_kind""", parameters)
    return [ToolErrorCount(*row) for row in rows]


def _trajectories(db: sqlite3.Connection, condition: str, source: str, step: int | None) -> list[TrajectoryRow]:
    where, parameters = _where(source, step)
    rows = db.execute(f"""
        SELECT step, example_id, group_id, sample_index, reward, em, num_tool_calls, answer, golden_answers
        FROM trajectories WHERE {where} AND {condition}
        ORDER BY step, group_id, sample_index""", parameters)
    return [TrajectoryRow(*row[:-1], "; ".join(json.loads(row[-1]))) for row in rows]


def answers_without_search(db: sqlite3.Connection, source: str, step: int | None = None) -> list[TrajectoryRow]:
    """Correct answers (EM, or the judge's verdict) from trajectories that made no tool call."""
    return _trajectories(db, "correct = 1 AND num_tool_calls = 0", source, step)


def format_only_rewards(db: sqlite3.Connection, source: str, step: int | None = None) -> list[TrajectoryRow]:
    """Trajectories rewarded (reward > 0) for a wrong answer: the reward came from the format and search terms alone."""
    return _trajectories(db, "reward > 0 AND correct = 0 AND failed = ''", source, step)


def staleness(db: sqlite3.Connection, source: str, step: int | None = None) -> list[StalenessCount]:
    """Per step, how many trajectories were sampled how many weight versions behind the policy they trained."""
    where, parameters = _where(source, step)
    rows = db.execute(f"""
        SELECT step, staleness, COUNT(*), COUNT(*) * 1.0 / SUM(COUNT(*)) OVER (PARTITION BY step)
        FROM trajectories WHERE {where} AND staleness IS NOT NULL
        GROUP BY step, staleness ORDER BY step, staleness""", parameters)
    return [StalenessCount(*row) for row in rows]


def truncations(db: sqlite3.Connection, source: str, step: int | None = None) -> list[TruncationCount]:
    """Per step and reason, the cuts (response budget, turn tokens, max turns, context window, tool output, prompt)
    and the trajectories they cut."""
    where, parameters = _where(source, step)
    cuts: dict[int, Counter] = {}
    cut_trajectories: dict[int, Counter] = {}
    totals: Counter = Counter()
    for at, reasons in db.execute(f"SELECT step, truncations FROM trajectories WHERE {where}", parameters):
        totals[at] += 1
        listed = [reason for reason in reasons.split(",") if reason]
        cuts.setdefault(at, Counter()).update(listed)
        cut_trajectories.setdefault(at, Counter()).update(set(listed))
    return [
        TruncationCount(at, reason, count, cut_trajectories[at][reason], cut_trajectories[at][reason] / totals[at])
        for at in sorted(cuts) for reason, count in sorted(cuts[at].items())
    ]
