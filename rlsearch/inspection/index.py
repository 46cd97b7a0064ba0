"""An SQLite index over a run's trajectory JSONL (RUN/inspect.sqlite), built incrementally.

Each file's indexed prefix (bytes and lines) is remembered, so a later update reads only what was appended since,
and new files. A last line without its newline (a run still writing) is left for the next update. A file whose
indexed part changed (a resumed run logs a step again) is indexed again from the start; a file that is gone is
dropped. A line that is not a trajectory record stops the update with an error naming its file and line; the lines
before it stay indexed and the update resumes at that line once it is fixed.
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

INDEX_FILE = "inspect.sqlite"
SCHEMA_VERSION = 2
INVALID_CALL_TOOL = "(invalid call)"  # the tool column of a turn that wrote no well-formed call
TRAIN, EVAL = "train", "eval"
REQUIRED_FIELDS = ("example_id", "group_id", "sample_index", "reward", "turns", "response_ids", "loss_mask")
_FINGERPRINT_BYTES = 4096
_STEP_NAME = re.compile(r"step_(\d+)(\.jsonl)?")

SCHEMA = """
CREATE TABLE files (
    path TEXT PRIMARY KEY,           -- relative to the run dir
    source TEXT NOT NULL,            -- train | eval
    step INTEGER NOT NULL,
    bytes_indexed INTEGER NOT NULL,
    lines_indexed INTEGER NOT NULL,
    fingerprint TEXT NOT NULL        -- of the indexed bytes' head and tail: tells a rewritten file
);
CREATE TABLE trajectories (
    id INTEGER PRIMARY KEY,
    file TEXT NOT NULL,
    line INTEGER NOT NULL,           -- 1-based
    byte_offset INTEGER NOT NULL,    -- where the record's line starts: the HTML page reads the record from there
    source TEXT NOT NULL,
    step INTEGER NOT NULL,
    example_id TEXT NOT NULL,
    group_id INTEGER NOT NULL,
    sample_index INTEGER NOT NULL,
    question TEXT NOT NULL,
    golden_answers TEXT NOT NULL,    -- JSON list
    reward REAL NOT NULL,
    em REAL,                         -- NULL: no EM score (an LLM judge's 'correct' instead)
    correct INTEGER NOT NULL,        -- the judge's 'correct' where scored, else EM > 0
    answer TEXT,                     -- the last <answer> (or the user agent's answer); NULL: none
    num_turns INTEGER NOT NULL,
    num_tool_calls INTEGER NOT NULL,
    num_invalid_calls INTEGER NOT NULL,
    finish_reason TEXT NOT NULL,
    failed TEXT NOT NULL,            -- '' = fine
    staleness INTEGER,               -- NULL: not recorded (eval, older runs)
    num_segments INTEGER NOT NULL,   -- > 1: the context was folded or rewritten
    truncations TEXT NOT NULL        -- every cut, comma-separated reasons in order ('' = none)
);
CREATE TABLE calls (                 -- a row per tool call, and per turn that failed without a call
    trajectory_id INTEGER NOT NULL,
    source TEXT NOT NULL,
    step INTEGER NOT NULL,
    turn INTEGER NOT NULL,
    tool TEXT NOT NULL,
    error_kind TEXT                  -- NULL: answered
);
CREATE INDEX trajectories_by_step ON trajectories (source, step);
CREATE INDEX trajectories_by_file ON trajectories (file);
CREATE INDEX calls_by_step ON calls (source, step);
"""


TRAJECTORY_COLUMNS = (
    "file", "line", "byte_offset", "source", "step", "example_id", "group_id", "sample_index", "question",
    "golden_answers", "reward", "em", "correct", "answer", "num_turns", "num_tool_calls", "num_invalid_calls",
    "finish_reason", "failed", "staleness", "num_segments", "truncations",
)


class InspectError(ValueError):
    """Bad input (a run dir without trajectories, a malformed record, an unknown step): the message says what."""


@dataclass(frozen=True)
class TrajectoryFile:
    path: Path
    source: str  # train | eval
    step: int


@dataclass(frozen=True)
class IndexUpdate:
    index_path: Path
    new_lines: int  # trajectories indexed by this update
    files_read: int  # files with new lines
    files_reindexed: list[str]  # indexed again from the start: their indexed part had changed
    total: int  # trajectories in the index

    def describe(self) -> str:
        text = (f"index {self.index_path}: {self.total} trajectories, {self.new_lines} new from "
                f"{self.files_read} file(s)")
        if self.files_reindexed:
            text += f"; indexed again (changed since): {', '.join(self.files_reindexed)}"
        return text


def trajectory_files(run_dir: Path) -> list[TrajectoryFile]:
    """A training run's trajectories/step_N.jsonl, its periodic evals' eval/step_N/trajectories.jsonl, and the
    trajectories.jsonl of an `rlsearch eval` output dir (step 0)."""
    files = [TrajectoryFile(path, TRAIN, int(match.group(1))) for path in run_dir.glob("trajectories/step_*.jsonl")
             if (match := _STEP_NAME.fullmatch(path.name))]
    files += [TrajectoryFile(path, EVAL, int(match.group(1))) for path in run_dir.glob("eval/step_*/trajectories.jsonl")
              if (match := _STEP_NAME.fullmatch(path.parent.name))]
    if (run_dir / "trajectories.jsonl").is_file():
        files.append(TrajectoryFile(run_dir / "trajectories.jsonl", EVAL, 0))
    return sorted(files, key=lambda file: (file.source, file.step, str(file.path)))


def open_index(run_dir: str | Path) -> sqlite3.Connection:
    """The run's index (created empty, or again when its schema is older than this code's)."""
    path = Path(run_dir) / INDEX_FILE
    db = sqlite3.connect(path)
    if db.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION:
        db.close()
        path.unlink(missing_ok=True)
        db = sqlite3.connect(path)
        db.executescript(SCHEMA)
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        db.commit()
    return db


def update_index(run_dir: str | Path) -> IndexUpdate:
    """Index what the run's trajectory files gained since the last update (see the module doc)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise InspectError(f"{run_dir} is not a directory")
    files = trajectory_files(run_dir)
    if not files:
        raise InspectError(f"{run_dir} holds no trajectories: neither trajectories/step_N.jsonl (a training run with "
                           "trainer.log_trajectories) nor eval/step_N/trajectories.jsonl or trajectories.jsonl (eval)")
    db = open_index(run_dir)
    try:
        _drop_missing_files(db, run_dir, files)
        new_lines, files_read, reindexed = 0, 0, []
        for file in files:
            relative = file.path.relative_to(run_dir).as_posix()
            start = _indexed_prefix(db, file.path, relative)
            if start is None:
                reindexed.append(relative)
                start = (0, 0)
            added = _index_file(db, file, relative, *start)
            new_lines += added
            files_read += added > 0
        total = db.execute("SELECT COUNT(*) FROM trajectories").fetchone()[0]
    finally:
        db.close()
    return IndexUpdate(run_dir / INDEX_FILE, new_lines, files_read, reindexed, total)


def _drop_missing_files(db: sqlite3.Connection, run_dir: Path, files: list[TrajectoryFile]) -> None:
    present = {file.path.relative_to(run_dir).as_posix() for file in files}
    for (path,) in db.execute("SELECT path FROM files").fetchall():
        if path not in present:
            _forget_file(db, path)
    db.commit()


def _forget_file(db: sqlite3.Connection, relative: str) -> None:
    db.execute("DELETE FROM calls WHERE trajectory_id IN (SELECT id FROM trajectories WHERE file = ?)", (relative,))
    db.execute("DELETE FROM trajectories WHERE file = ?", (relative,))
    db.execute("DELETE FROM files WHERE path = ?", (relative,))


def _indexed_prefix(db: sqlite3.Connection, path: Path, relative: str) -> tuple[int, int] | None:
    """(bytes, lines) of `path` already indexed; None when its indexed part changed (its rows are dropped)."""
    row = db.execute("SELECT bytes_indexed, lines_indexed, fingerprint FROM files WHERE path = ?",
                     (relative,)).fetchone()
    if row is None:
        return 0, 0
    bytes_indexed, lines_indexed, fingerprint = row
    if path.stat().st_size >= bytes_indexed and _fingerprint(path, bytes_indexed) == fingerprint:
        return bytes_indexed, lines_indexed
    _forget_file(db, relative)
    db.commit()
    return None


def _fingerprint(path: Path, size: int) -> str:
    with path.open("rb") as handle:
        head = handle.read(min(size, _FINGERPRINT_BYTES))
        handle.seek(max(0, size - _FINGERPRINT_BYTES))
        tail = handle.read(size - handle.tell())
    return hashlib.sha256(head + tail).hexdigest()


def _complete_lines(path: Path, offset: int) -> Iterator[tuple[int, bytes]]:
    """(byte offset, line) of each newline-terminated line from `offset`; a partial last line is not yielded."""
    with path.open("rb") as handle:
        handle.seek(offset)
        for line in handle:
            if not line.endswith(b"\n"):
                return
            yield offset, line
            offset += len(line)


def _index_file(db: sqlite3.Connection, file: TrajectoryFile, relative: str, offset: int, lines: int) -> int:
    """Index the complete lines of `file` after its indexed prefix. The lines before a malformed one are indexed
    (and the file's prefix moved up to it) before its error is raised."""
    records: list[tuple[int, int, _IndexedRecord]] = []  # (line, byte offset, rows)
    error = None
    for line_offset, line in _complete_lines(file.path, offset):
        try:
            records.append((lines + 1, line_offset, _read_record(line, f"{file.path}:{lines + 1}")))
        except InspectError as malformed:
            error = malformed
            break
        offset, lines = line_offset + len(line), lines + 1
    insert = (f"INSERT INTO trajectories ({', '.join(TRAJECTORY_COLUMNS)}) "
              f"VALUES ({', '.join('?' * len(TRAJECTORY_COLUMNS))})")
    for line_number, line_offset, record in records:
        cursor = db.execute(insert, (relative, line_number, line_offset, file.source, file.step, *record.values))
        db.executemany("INSERT INTO calls VALUES (?, ?, ?, ?, ?, ?)",
                       [(cursor.lastrowid, file.source, file.step, *call) for call in record.calls])
    if records:
        db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?)",
                   (relative, file.source, file.step, offset, lines, _fingerprint(file.path, offset)))
        db.commit()
    if error is not None:
        raise error
    return len(records)


@dataclass(frozen=True)
class _IndexedRecord:
    values: tuple  # the trajectories columns after file, line, byte_offset, source and step
    calls: list[tuple[int, str, str | None]]  # (turn, tool, error_kind)


def _read_record(line: bytes, where: str) -> _IndexedRecord:
    """The index rows of one JSONL line; InspectError naming `where` (file:line) when it is not a trajectory."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InspectError(f"{where}: not a JSON trajectory record ({error}); fix or delete that line and run "
                           "again (the lines before it are indexed)") from error
    if not isinstance(record, dict):
        raise InspectError(f"{where}: a JSON {type(record).__name__}, not a trajectory record (an object)")
    missing = [name for name in REQUIRED_FIELDS if name not in record]
    if missing:
        raise InspectError(f"{where}: not a trajectory record, it lacks {', '.join(missing)}")
    try:
        return _index_rows(record)
    except (KeyError, TypeError, AttributeError) as error:
        raise InspectError(f"{where}: a trajectory record of an unexpected shape ({type(error).__name__}: "
                           f"{error})") from error


def _is_correct(scores: dict) -> bool:
    """An LLM judge's verdict where the record has one, else exact match."""
    return scores.get("correct", scores.get("em", 0.0)) > 0


def answer_of(record: dict) -> str | None:
    """What the trajectory answered: a user agent's returned answer, else the model's last <answer> block."""
    if record.get("agent_answer") is not None:
        return record["agent_answer"]
    from ..reward.qa import extract_answer  # here: the reward package loads a judge client, slow for `rlsearch -h`

    model_text = record.get("assistant_prefix", "") + "".join(turn["text"] for turn in record["turns"])
    return extract_answer(model_text)


def _index_rows(record: dict) -> _IndexedRecord:
    scores = record.get("scores") or {}
    turns = record["turns"]
    values = (
        str(record["example_id"]), int(record["group_id"]), int(record["sample_index"]), record.get("question", ""),
        json.dumps(record.get("golden_answers", [])), float(record["reward"]), scores.get("em"), _is_correct(scores),
        answer_of(record), len(turns), sum(len(turn["tool_calls"]) for turn in turns),
        sum(turn["kind"] == "invalid_call" for turn in turns), record.get("finish_reason") or "",
        record.get("failed") or "", record.get("staleness"), 1 + len(record.get("earlier_segments") or []),
        ",".join(record.get("truncations") or []),
    )
    calls = []
    for turn_index, turn in enumerate(turns):
        calls += [(turn_index, call["name"], call.get("error_kind")) for call in turn["tool_calls"]]
        if not turn["tool_calls"] and turn.get("error_kind"):  # an invalid call: the turn holds no call record
            calls.append((turn_index, INVALID_CALL_TOOL, turn["error_kind"]))
    return _IndexedRecord(values, calls)
