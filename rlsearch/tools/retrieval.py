"""BM25 retrieval over a JSONL corpus, served over HTTP with Search-R1's ``/retrieve`` API."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
from pathlib import Path

import bm25s
import fastapi
import numpy as np
import uvicorn
from pydantic import BaseModel, Field, StrictBool, StrictStr

STOPWORDS = "en"
MAX_TOPK = 100


class BM25Retriever:
    """BM25 index over passages ``{"id": ..., "contents": ...}``.

    Only passages sharing at least one term with the query are returned, so a query made only of stopwords
    or unknown words (or an empty one) gets no results.
    """

    def __init__(self, ids: list, contents: list[str], index: bm25s.BM25, loaded_from_cache: bool) -> None:
        self._ids = ids
        self._contents = contents
        self._index = index
        self.loaded_from_cache = loaded_from_cache

    @classmethod
    def from_corpus(cls, corpus_path: str | Path, cache_dir: str | Path | None = None) -> BM25Retriever:
        """Read the corpus and build its index, or reload the index cached for identical corpus bytes."""
        ids, contents, digest = _read_corpus(Path(corpus_path))
        cached_index_dir = Path(cache_dir) / _index_dir_name(digest) if cache_dir else None
        if cached_index_dir is not None and cached_index_dir.is_dir():
            index = bm25s.BM25.load(str(cached_index_dir), show_progress=False)
            return cls(ids, contents, index, loaded_from_cache=True)
        index = _build_index(contents)
        if cached_index_dir is not None:
            _save_atomically(index, cached_index_dir)
        return cls(ids, contents, index, loaded_from_cache=False)

    @property
    def num_documents(self) -> int:
        return len(self._contents)

    def search(self, queries: list[str], topk: int) -> list[list[tuple[dict, float]]]:
        """Best-first ``({"id", "contents"}, score)`` pairs per query, at most ``topk`` each."""
        topk = min(topk, self.num_documents)
        if not queries or topk < 1:
            return [[] for _ in queries]
        query_tokens = bm25s.tokenize(queries, stopwords=STOPWORDS, return_ids=False, show_progress=False)
        indices, scores = self._index.retrieve(query_tokens, k=topk, show_progress=False)
        return [self._hits(row, row_scores) for row, row_scores in zip(indices, scores, strict=True)]

    def _hits(self, indices: np.ndarray, scores: np.ndarray) -> list[tuple[dict, float]]:
        return [
            ({"id": self._ids[i], "contents": self._contents[i]}, float(score))
            for i, score in zip(indices.tolist(), scores.tolist(), strict=True)
            if score > 0
        ]


def _index_dir_name(corpus_digest: str) -> str:
    return f"bm25s-{bm25s.__version__}-{STOPWORDS}-{corpus_digest}"


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


def _build_index(contents: list[str]) -> bm25s.BM25:
    index = bm25s.BM25()
    index.index(bm25s.tokenize(contents, stopwords=STOPWORDS, show_progress=False), show_progress=False)
    return index


def _save_atomically(index: bm25s.BM25, target_dir: Path) -> None:
    # Write elsewhere then rename, so a concurrent or crashed writer never leaves a half index to load.
    staging_dir = target_dir.with_name(f"{target_dir.name}.tmp-{os.getpid()}")
    index.save(str(staging_dir), show_progress=False)
    try:
        staging_dir.rename(target_dir)
    except OSError:
        if not target_dir.is_dir():
            raise
        shutil.rmtree(staging_dir)


class RetrieveRequest(BaseModel):
    queries: list[StrictStr]
    topk: int = Field(default=3, ge=1, le=MAX_TOPK)
    return_scores: StrictBool = False


def create_app(retriever: BM25Retriever) -> fastapi.FastAPI:
    app = fastapi.FastAPI(title="rlsearch BM25 retriever")

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "num_documents": retriever.num_documents}

    # A plain (non-async) endpoint: FastAPI runs it in a worker thread, keeping the event loop free.
    @app.post("/retrieve")
    def retrieve(request: RetrieveRequest) -> dict:
        results = retriever.search(request.queries, request.topk)
        if request.return_scores:
            scored = [[{"document": doc, "score": score} for doc, score in hits] for hits in results]
            return {"result": scored}
        return {"result": [[doc for doc, _ in hits] for hits in results]}

    return app


class _AnnouncingServer(uvicorn.Server):
    """Prints the bound address once the socket listens (the real port matters when port 0 was asked)."""

    def __init__(self, config: uvicorn.Config, num_documents: int) -> None:
        super().__init__(config)
        self._num_documents = num_documents

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.should_exit:
            return
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        print(f"retriever listening on http://{host}:{port} ({self._num_documents} documents)", flush=True)


def serve_retriever(
    corpus: str, host: str = "127.0.0.1", port: int = 8000, cache_dir: str | None = None
) -> None:
    """Index ``corpus`` and serve it until interrupted. ``port=0`` picks a free port (printed)."""
    retriever = BM25Retriever.from_corpus(corpus, cache_dir)
    config = uvicorn.Config(create_app(retriever), host=host, port=port, log_level="warning")
    _AnnouncingServer(config, retriever.num_documents).run()


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve BM25 retrieval over a JSONL corpus (Search-R1 API).")
    parser.add_argument("--corpus", required=True, help='JSONL file, one {"id", "contents"} object per line')
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--cache-dir", default=None, help="where built indexes are kept for reuse")
    args = parser.parse_args()
    serve_retriever(args.corpus, host=args.host, port=args.port, cache_dir=args.cache_dir)


if __name__ == "__main__":
    main()
