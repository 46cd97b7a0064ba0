"""Reading the JSONL files the code under test writes (corpora, QA sets, demonstrations)."""

from __future__ import annotations

import json
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSONL file, one object a line."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
