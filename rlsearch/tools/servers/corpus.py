"""A JSONL corpus of passages and the hits a retriever returns over it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

Hits = list[tuple[dict, float]]  # best-first ({"id", "contents"}, score) pairs of one query


@dataclass
class Corpus:
    """Passages ``{"id", "contents"}`` of a JSONL file, with the SHA-256 of its bytes (the cache key)."""

    ids: list
    contents: list[str]
    digest: str
    _positions: dict[str, int] = field(default_factory=dict, repr=False)

    @classmethod
    def read(cls, path: str | Path) -> Corpus:
        ids, contents, digest = _read_corpus(Path(path))
        return cls(ids, contents, digest)

    def __len__(self) -> int:
        return len(self.contents)

    def document(self, index: int) -> dict:
        return {"id": self.ids[index], "contents": self.contents[index]}

    def find(self, doc_id: str) -> dict | None:
        """The passage with this id (compared as text), or None."""
        if not self._positions:
            self._positions = {str(passage_id): index for index, passage_id in enumerate(self.ids)}
        index = self._positions.get(str(doc_id))
        return None if index is None else self.document(index)


def _read_corpus(path: Path) -> tuple[list, list[str], str]:
    """Parse the JSONL corpus and hash its bytes in the same single pass."""
    digest = hashlib.sha256()
    ids, contents = [], []
    with path.open("rb") as corpus_file:
        for line_number, line in enumerate(corpus_file, start=1):
            digest.update(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                ids.append(record["id"])
                contents.append(record["contents"])
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f'{path}:{line_number}: expected {{"id", "contents"}}: {error}') from error
    if not contents:
        raise ValueError(f"{path}: the corpus has no passages")
    return ids, contents, digest.hexdigest()
