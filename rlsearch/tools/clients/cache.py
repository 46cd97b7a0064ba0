"""An on-disk cache of successful tool results keyed by (tool, query, attributes), for reproducible runs."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from pathlib import Path

from ..base import Document, ToolCall


class ToolCache:
    """One JSON file per distinct call under ``root/<2 hex>/<sha256>.json``, written atomically.

    Only successful results are stored, so a transient failure is retried on the next run. Several processes may
    share one directory: the last writer of identical content wins.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.hits = 0
        self.misses = 0

    def get(self, call: ToolCall) -> list[Document] | None:
        path = self._path(call)
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            documents = [Document(**document) for document in record["documents"]]
        except (OSError, ValueError, KeyError, TypeError):  # absent, or corrupt: a miss that the next put rewrites
            self.misses += 1
            return None
        self.hits += 1
        return documents

    def put(self, call: ToolCall, documents: list[Document]) -> None:
        path = self._path(call)
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"call": _key_fields(call), "documents": [dataclasses.asdict(d) for d in documents]}
        staging = path.with_name(f"{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")  # writers may race
        staging.write_text(json.dumps(record, ensure_ascii=False), encoding="utf-8")
        os.replace(staging, path)

    def _path(self, call: ToolCall) -> Path:
        digest = hashlib.sha256(json.dumps(_key_fields(call), sort_keys=True).encode()).hexdigest()
        return self.root / digest[:2] / f"{digest}.json"


def _key_fields(call: ToolCall) -> dict:
    fields = {"tool": call.name, "query": call.query, "attrs": dict(sorted(call.attrs.items()))}
    if call.arguments is not None:  # typed calls differ by their arguments (the query may be empty)
        fields["arguments"] = call.arguments
    return fields
