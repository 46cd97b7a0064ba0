"""A JSONL corpus of passages and the hits a retriever returns over it: read whole (`Corpus`, for the indexes rlsearch
builds) or one passage at a time through an offset index (`LineCorpus`, for a prebuilt index over millions)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...files import atomic_path

Hits = list[tuple[dict, float]]  # best-first ({"id", "contents"}, score) pairs of one query


def search_index(index, corpus: Corpus | LineCorpus, encode: Callable[[list[str]], np.ndarray], queries: list[str],
                 topk: int) -> list[Hits]:
    """Best-first (passage, score) pairs per query from a FAISS `index` whose rows are `corpus`'s passages, the
    queries made vectors by `encode`. An empty query has no meaning to match (as with BM25, it gets no results)."""
    topk = min(topk, len(corpus))
    results: list[Hits] = [[] for _ in queries]
    asked = [position for position, query in enumerate(queries) if query.strip()]
    if not asked or topk < 1:
        return results
    scores, rows = index.search(encode([queries[i] for i in asked]), topk)
    for position, query_index in enumerate(asked):
        results[query_index] = [
            (corpus.document(row), float(score))
            for row, score in zip(rows[position].tolist(), scores[position].tolist())
            if row >= 0
        ]
    return results


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


OFFSETS_SUFFIX = ".offsets.npy"
_SCAN_BYTES = 64 << 20  # the corpus is scanned for line starts this much at a time
_HEADER = 2  # the offsets file starts with the corpus's size and mtime (ns): a changed corpus is scanned again


class LineCorpus:
    """A JSONL corpus read one passage at a time: the start of every non-empty line is kept in a uint64 array (8 bytes
    a passage: 170 MB for Search-R1's 21M-passage wiki-18), built once and cached beside the corpus (or in
    ``cache_dir`` where the corpus's folder is read-only), memory-mapped; a hit is one positioned read. Row i is the
    i-th non-empty line, as a FAISS index built over the corpus numbers them."""

    def __init__(self, path: Path, starts: np.ndarray) -> None:
        self.path = path
        self._starts = starts
        self._size = path.stat().st_size
        self._fd = os.open(path, os.O_RDONLY)

    @classmethod
    def open(cls, path: str | Path, cache_dir: str | Path | None = None) -> LineCorpus:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"corpus not found: {path}")
        corpus = cls(path, _line_starts(path, cache_dir))
        if not len(corpus):
            raise ValueError(f"{path}: the corpus has no passages")
        corpus.document(0)  # a file that is not {"id", "contents"} JSONL fails here, not at the first search
        return corpus

    def __len__(self) -> int:
        return len(self._starts) - _HEADER

    def document(self, index: int) -> dict:
        start = int(self._starts[_HEADER + index])
        end = int(self._starts[_HEADER + index + 1]) if index + 1 < len(self) else self._size
        line = os.pread(self._fd, end - start, start).split(b"\n", 1)[0]
        try:
            record = json.loads(line)
            return {"id": record["id"], "contents": record["contents"]}
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f'{self.path}: passage {index} (byte {start}) is not {{"id", "contents"}}: '
                             f"{error}") from error

    def close(self) -> None:
        os.close(self._fd)


def _line_starts(path: Path, cache_dir: str | Path | None) -> np.ndarray:
    """[size, mtime_ns, start of each non-empty line...]: the cached array when it matches the corpus, else scanned
    and cached (beside the corpus, else in cache_dir, else kept in memory only)."""
    stat = path.stat()
    stamp = [stat.st_size, stat.st_mtime_ns]
    places = [path.with_name(path.name + OFFSETS_SUFFIX)]
    if cache_dir:
        key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
        places.append(Path(cache_dir) / f"{path.name}-{key}{OFFSETS_SUFFIX}")
    for place in places:
        try:
            cached = np.load(place, mmap_mode="r")
        except (OSError, ValueError):
            continue
        if cached.dtype == np.uint64 and len(cached) >= _HEADER and cached[:_HEADER].tolist() == stamp:
            return cached
    starts = np.concatenate([np.asarray(stamp, dtype=np.uint64), _scan_line_starts(path)])
    for place in places:
        try:
            place.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(place) as staging, staging.open("wb") as staging_file:
                np.save(staging_file, starts)
            return np.load(place, mmap_mode="r")
        except OSError:
            continue
    return starts


def _scan_line_starts(path: Path) -> np.ndarray:
    """The byte offset of every non-empty line (a line holding only "\\r" counts as empty)."""
    starts, position = [np.zeros(1, dtype=np.uint64)], 0
    with path.open("rb") as corpus_file:
        while chunk := corpus_file.read(_SCAN_BYTES):
            buffer = np.frombuffer(chunk, dtype=np.uint8)
            newlines = np.flatnonzero(buffer == 10).astype(np.uint64) + np.uint64(position)
            starts.append(newlines + np.uint64(1))
            position += len(chunk)
    starts = np.concatenate(starts)
    ends = np.append(starts[1:] - np.uint64(1), np.uint64(position))  # each line's end (its newline, or EOF)
    lengths = ends - starts
    keep = lengths > 0
    if keep.any() and (lengths == 1).any():  # one-byte lines: blank when the byte is "\r"
        with path.open("rb") as corpus_file:
            for index in np.flatnonzero(lengths == 1):
                corpus_file.seek(int(starts[index]))
                keep[index] = corpus_file.read(1) != b"\r"
    return starts[keep]
