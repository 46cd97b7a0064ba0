"""The results file of an eval run: one scored trajectory per JSONL line, appended batch by batch, safe to kill at any
time."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from ..data import DatasetError
from ..files import atomic_path

ResultKey = tuple[str, str, int]  # (eval_file, example_id, sample_index)


def result_key(record: dict) -> ResultKey:
    return record["eval_file"], record["example_id"], record["sample_index"]


class ResultsFile:
    """Records are appended in whole lines and synced to disk after each batch (or the file rewritten whole).

    A run killed while writing leaves at most a torn last line (no newline yet): `load` drops it and cuts it off
    the file, so the next append starts on a fresh line.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def load(self) -> list[dict]:
        if not self.path.is_file():
            return []
        data = self.path.read_bytes()
        complete_end = data.rfind(b"\n") + 1
        if complete_end < len(data):
            with self.path.open("r+b") as handle:
                handle.truncate(complete_end)
        records = []
        for line_number, line in enumerate(data[:complete_end].splitlines(), start=1):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise DatasetError(
                    f"{self.path}:{line_number}: not a JSON record ({error.msg}); the file was edited or corrupted, "
                    "fix or delete that line to resume"
                ) from error
        return records

    def append(self, records: Iterable[dict]) -> None:
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(_lines(records))
            handle.flush()
            os.fsync(handle.fileno())

    def rewrite(self, records: Iterable[dict]) -> None:
        """The file holds just ``records`` (replaced in one rename: a kill leaves the old file or the new one)."""
        with atomic_path(self.path) as staging, staging.open("w", encoding="utf-8") as handle:
            handle.write(_lines(records))
            handle.flush()
            os.fsync(handle.fileno())


def _lines(records: Iterable[dict]) -> str:
    return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
