"""A run's store of tool results: every successful result by (tool, query, attributes; the question for a tool that
reads it), and the tools' specs, so that a rerun or an eval can replay the run without calling a tool
(tools.replay)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

from ...files import atomic_path
from ..base import Document, ToolCall, ToolSpec

SPECS_FILE = "tools.json"


class ReplayMissError(RuntimeError):
    """tools.replay: a call the store has no result for (the recorded run never made it). It stops the run."""


class ToolCache:
    """One JSON file per distinct call under ``root/<2 hex>/<sha256>.json``, and the tools' specs in ``tools.json``,
    each written atomically.

    Only successful results are stored, so a transient failure is retried on the next run. Several processes may
    share one directory: the last writer of identical content wins.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.hits = 0
        self.misses = 0
        self.write_errors = 0

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
        """Store a result; a store that cannot be written (a full disk) is reported once and never fails the call."""
        path = self._path(call)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            record = {"call": _key_fields(call), "documents": [dataclasses.asdict(d) for d in documents]}
            _write_atomically(path, record)
        except OSError as error:
            self.write_errors += 1
            if self.write_errors == 1:
                print(f"[rlsearch] the tool store {self.root} cannot be written ({error}); results are not kept, so "
                      "a replay of this run will miss them", file=sys.stderr, flush=True)

    def save_specs(self, specs: list[ToolSpec]) -> None:
        """The tools a replay offers the model (their names, descriptions and schemas go into its prompt)."""
        _write_atomically(self.root / SPECS_FILE, [dataclasses.asdict(spec) for spec in specs])

    def load_specs(self) -> list[ToolSpec]:
        path = self.root / SPECS_FILE
        if not path.is_file():
            raise ReplayMissError(f"tools.replay: {path} does not exist; tools.cache_dir must be the tool_store of a "
                                  "recorded run (it holds the tools' specs and results)")
        return [ToolSpec(**spec) for spec in json.loads(path.read_text(encoding="utf-8"))]

    def miss(self, call: ToolCall) -> ReplayMissError:
        """The error of a replayed call the store lacks, naming the call."""
        return ReplayMissError(f"tools.replay: the store {self.root} has no result for the call "
                               f"{json.dumps(_key_fields(call), ensure_ascii=False)} (the recorded run never made it)")

    def _path(self, call: ToolCall) -> Path:
        digest = call_key(call)
        return self.root / digest[:2] / f"{digest}.json"


def call_key(call: ToolCall) -> str:
    """The call's identity: sha256 of its tool, query and attributes (typed calls: and arguments)."""
    return hashlib.sha256(json.dumps(_key_fields(call), sort_keys=True).encode()).hexdigest()


def _key_fields(call: ToolCall) -> dict:
    fields = {"tool": call.name, "query": call.query, "attrs": dict(sorted(call.attrs.items()))}
    if call.arguments is not None:  # typed calls differ by their arguments (the query may be empty)
        fields["arguments"] = call.arguments
    if call.question:  # a tool that reads the question (a summarised browse) answers each question apart
        fields["question"] = call.question
    return fields


def _write_atomically(path: Path, record: object) -> None:
    with atomic_path(path) as staging:  # writers may race: each has its own staging name
        staging.write_text(json.dumps(record, ensure_ascii=False), encoding="utf-8")
