"""Retrieval over a JSONL corpus (BM25, dense, or hybrid), served over HTTP with Search-R1's ``/retrieve`` API.

Concurrent requests are micro-batched: requests that arrive while a search runs are searched together in the next
index call, so many small clients cost one large search instead of many small ones. Requests are bounded (body
size: 413; number of queries, query length, topk: 422 naming the limit) and, when the token variable is set where
the server starts, must carry ``Authorization: Bearer <token>`` (401).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import fastapi
import numpy as np
from pydantic import BaseModel, Field, StrictBool, StrictStr

from ..http import DEFAULT_MAX_BODY_BYTES, RETRIEVER_TOKEN_ENV
from ..search_api import MAX_QUERIES, MAX_QUERY_CHARS, MAX_TOPK
from .corpus import Corpus, Hits
from .options import BACKENDS, add_retriever_server_arguments, run_server
from .prebuilt import EncoderSettings, SearchWidth
from .serving import guard, serve_app

if TYPE_CHECKING:
    import bm25s  # imported where BM25 is used: a server of a prebuilt dense index does without its memory

STOPWORDS = "en"
RRF_K = 60  # reciprocal rank fusion constant (Cormack et al.): score = sum over rankings of 1 / (RRF_K + rank)
MAX_BATCH_QUERIES = 512  # queries per index call when concurrent requests are merged

class Retriever(Protocol):
    corpus: Corpus

    def search(self, queries: list[str], topk: int) -> list[Hits]: ...


class BM25Retriever:
    """BM25 index over a corpus.

    Only passages sharing at least one term with the query are returned, so a query made only of stopwords
    or unknown words (or an empty one) gets no results.
    """

    def __init__(self, corpus: Corpus, index: bm25s.BM25, loaded_from_cache: bool) -> None:
        self.corpus = corpus
        self._index = index
        self.loaded_from_cache = loaded_from_cache

    @classmethod
    def from_corpus(cls, corpus_path: str | Path, cache_dir: str | Path | None = None) -> BM25Retriever:
        return cls.build(Corpus.read(corpus_path), cache_dir)

    @classmethod
    def build(cls, corpus: Corpus, cache_dir: str | Path | None = None) -> BM25Retriever:
        """Build the index, or reload the one cached for identical corpus bytes."""
        import bm25s

        cached_index_dir = Path(cache_dir) / _index_dir_name(corpus.digest) if cache_dir else None
        if cached_index_dir is not None and cached_index_dir.is_dir():
            index = bm25s.BM25.load(str(cached_index_dir), show_progress=False)
            return cls(corpus, index, loaded_from_cache=True)
        index = _build_index(corpus.contents)
        if cached_index_dir is not None:
            _save_atomically(index, cached_index_dir)
        return cls(corpus, index, loaded_from_cache=False)

    @property
    def num_documents(self) -> int:
        return len(self.corpus)

    def search(self, queries: list[str], topk: int) -> list[Hits]:
        """Best-first ``({"id", "contents"}, score)`` pairs per query, at most ``topk`` each."""
        topk = min(topk, self.num_documents)
        if not queries or topk < 1:
            return [[] for _ in queries]
        import bm25s

        query_tokens = bm25s.tokenize(queries, stopwords=STOPWORDS, return_ids=False, show_progress=False)
        indices, scores = self._index.retrieve(query_tokens, k=topk, show_progress=False)
        return [self._hits(row, row_scores) for row, row_scores in zip(indices, scores, strict=True)]

    def _hits(self, indices: np.ndarray, scores: np.ndarray) -> Hits:
        return [
            (self.corpus.document(i), float(score))
            for i, score in zip(indices.tolist(), scores.tolist(), strict=True)
            if score > 0
        ]


class HybridRetriever:
    """BM25 and dense rankings fused by reciprocal rank fusion (each ranking contributes 1 / (RRF_K + rank))."""

    def __init__(self, bm25: BM25Retriever, dense) -> None:
        self.corpus = bm25.corpus
        self._rankers = (bm25, dense)

    def search(self, queries: list[str], topk: int) -> list[Hits]:
        depth = min(len(self.corpus), max(2 * topk, 20))  # fuse deeper lists than asked so both can contribute
        rankings = [ranker.search(queries, depth) for ranker in self._rankers]
        return [self._fuse([ranking[q] for ranking in rankings], topk) for q in range(len(queries))]

    @staticmethod
    def _fuse(rankings: list[Hits], topk: int) -> Hits:
        fused: dict[str, float] = {}
        documents: dict[str, dict] = {}
        for hits in rankings:
            for rank, (document, _) in enumerate(hits, start=1):
                key = str(document["id"])
                fused[key] = fused.get(key, 0.0) + 1.0 / (RRF_K + rank)
                documents[key] = document
        best = sorted(fused, key=lambda key: -fused[key])[:topk]
        return [(documents[key], fused[key]) for key in best]


def build_retriever(
    corpus_path: str | Path, backend: str = "bm25", cache_dir: str | Path | None = None, encoder: str = "",
    prebuilt: PrebuiltIndex | None = None,
) -> Retriever:
    """A retriever of the given backend; indexes and embeddings are cached under ``cache_dir`` when given. With
    ``prebuilt`` (backend dense): that index over the corpus, searched with ``encoder`` as it was built."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown retrieval backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if prebuilt is not None:
        if backend != "dense":
            raise ValueError(f"a prebuilt index is searched with its encoder's embeddings (backend dense); backend "
                             f"{backend} cannot use it")
        from .prebuilt import PrebuiltIndexRetriever

        return PrebuiltIndexRetriever.load(prebuilt.index, corpus_path, prebuilt.encoder_settings(encoder), cache_dir,
                                           prebuilt.faiss_gpu, prebuilt.width)
    corpus = Corpus.read(corpus_path)
    if backend == "bm25":
        return BM25Retriever.build(corpus, cache_dir)
    from .dense import DenseRetriever

    dense = DenseRetriever.build(corpus, cache_dir, encoder)
    return dense if backend == "dense" else HybridRetriever(BM25Retriever.build(corpus, cache_dir), dense)


def _index_dir_name(corpus_digest: str) -> str:
    import bm25s

    return f"bm25s-{bm25s.__version__}-{STOPWORDS}-{corpus_digest}"


def _build_index(contents: list[str]) -> bm25s.BM25:
    import bm25s

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


@dataclass(frozen=True)
class PrebuiltIndex:
    """A prebuilt FAISS index to serve (``serve-retriever --index``) and how its encoder embeds queries."""

    index: str
    encoder_family: str = ""
    pooling: str = "auto"
    query_prefix: str | None = None
    faiss_gpu: bool = False
    width: SearchWidth = SearchWidth()
    encoder_device: str = "auto"

    def encoder_settings(self, encoder: str) -> EncoderSettings:
        if not encoder:
            raise ValueError(f"the prebuilt index {self.index} needs the encoder it was built with: give --encoder "
                             "(Search-R1: --retriever_model), a HuggingFace encoder dir")
        if self.encoder_family.lower() == "bm25":
            raise ValueError("a Search-R1 BM25 index (pyserini/Lucene) is not a FAISS index: serve the corpus with "
                             "--backend bm25 instead (rlsearch builds its own BM25 index)")
        return EncoderSettings(encoder, self.encoder_family, self.pooling, self.query_prefix, self.encoder_device)


@dataclass(frozen=True)
class CorpusIndex:
    """What a tool server searches (``serve-retriever``, ``serve-mcp``): the corpus, the backend that indexes it, where
    indexes and embeddings are kept (``cache_dir``), the dense encoder and (``serve-retriever --index``) a prebuilt
    index."""

    corpus: str
    backend: str = "bm25"
    cache_dir: str | None = None
    encoder: str = ""
    prebuilt: PrebuiltIndex | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace, prebuilt: PrebuiltIndex | None = None) -> CorpusIndex:
        """The index of the options of ``add_retriever_arguments``; the backend is dense by default with
        ``prebuilt``, else bm25."""
        backend = args.backend or ("dense" if prebuilt else "bm25")
        return cls(args.corpus, backend, args.cache_dir, args.encoder or "", prebuilt)

    def build(self) -> Retriever:
        return build_retriever(self.corpus, self.backend, self.cache_dir, self.encoder, self.prebuilt)

    def describe(self) -> str:
        """The backend (and the prebuilt index), as a server's start-up line says it."""
        return f"{self.backend}, index {self.prebuilt.index}" if self.prebuilt else self.backend


class RetrieveRequest(BaseModel):
    queries: list[StrictStr]
    topk: int | None = Field(default=None, ge=1)  # None: the server's default; at most its RequestLimits.max_topk
    return_scores: StrictBool = False


@dataclass(frozen=True)
class RequestLimits:
    """What one /retrieve request may ask for (``serve-retriever --max-...``)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger bodies: 413
    max_queries: int = MAX_QUERIES  # more queries: 422
    max_query_chars: int = MAX_QUERY_CHARS  # a longer query: 422
    max_topk: int = MAX_TOPK  # a larger topk: 422

    def violation(self, request: RetrieveRequest) -> str | None:
        """Why ``request`` is over a limit, or None."""
        if len(request.queries) > self.max_queries:
            count = len(request.queries)
            return f"{count} queries in one request; this server's limit is max_queries={self.max_queries}"
        for index, query in enumerate(request.queries):
            if len(query) > self.max_query_chars:
                return (
                    f"queries[{index}] has {len(query)} characters; this server's limit is "
                    f"max_query_chars={self.max_query_chars}"
                )
        if request.topk is not None and request.topk > self.max_topk:
            return f"topk={request.topk} is over this server's limit max_topk={self.max_topk}"
        return None


@dataclass
class _PendingSearch:
    queries: list[str]
    topk: int
    result: asyncio.Future


class MicroBatcher:
    """Searches the queries of concurrent requests together.

    One worker task takes the first waiting request plus every request queued behind it (up to
    ``max_batch_queries`` queries), runs one index call off the event loop, and hands each request its slice.
    No request waits for a timer: batches form from the requests that arrive while the previous search runs.
    """

    def __init__(self, retriever: Retriever, max_batch_queries: int = MAX_BATCH_QUERIES) -> None:
        self.retriever = retriever
        self.max_batch_queries = max_batch_queries
        self.num_batches = 0
        self._queue: asyncio.Queue[_PendingSearch] = asyncio.Queue()

    async def search(self, queries: list[str], topk: int) -> list[Hits]:
        pending = _PendingSearch(queries, topk, asyncio.get_running_loop().create_future())
        await self._queue.put(pending)
        return await pending.result

    async def run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            num_queries = len(batch[0].queries)
            while not self._queue.empty() and num_queries < self.max_batch_queries:
                batch.append(self._queue.get_nowait())
                num_queries += len(batch[-1].queries)
            await self._search_batch(batch)

    async def _search_batch(self, batch: list[_PendingSearch]) -> None:
        queries = [query for pending in batch for query in pending.queries]
        try:
            results = await asyncio.to_thread(self.retriever.search, queries, max(p.topk for p in batch))
        except Exception as error:  # every request of the batch fails with it; the worker goes on
            for pending in batch:
                if not pending.result.done():
                    pending.result.set_exception(error)
            return
        self.num_batches += 1
        start = 0
        for pending in batch:
            hits = results[start : start + len(pending.queries)]
            start += len(pending.queries)
            if not pending.result.done():  # done: the client went away and its request was cancelled
                pending.result.set_result([query_hits[: pending.topk] for query_hits in hits])


def create_app(
    retriever: Retriever, limits: RequestLimits = RequestLimits(), token_env: str = RETRIEVER_TOKEN_ENV,
    default_topk: int = 3,
):
    """The ASGI app: /health and /retrieve behind the token check (the token is read from the variable
    ``token_env`` now; unset or "": none required) and the body-size bound. A request without topk gets
    ``default_topk`` passages per query."""
    batcher = MicroBatcher(retriever)

    @asynccontextmanager
    async def lifespan(_: fastapi.FastAPI):
        worker = asyncio.create_task(batcher.run())
        yield
        worker.cancel()

    app = fastapi.FastAPI(title="rlsearch retriever", lifespan=lifespan)

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "num_documents": len(retriever.corpus)}

    @app.post("/retrieve")
    async def retrieve(request: RetrieveRequest) -> fastapi.Response:
        violation = limits.violation(request)
        if violation is not None:
            return fastapi.responses.JSONResponse({"detail": violation}, status_code=422)
        results = await batcher.search(request.queries, request.topk or default_topk)
        if request.return_scores:
            body = {"result": [[{"document": doc, "score": score} for doc, score in hits] for hits in results]}
        else:
            body = {"result": [[doc for doc, _ in hits] for hits in results]}
        # serialised directly: FastAPI's generic encoder walks every value and costs more than the search
        return fastapi.Response(json.dumps(body, ensure_ascii=False), media_type="application/json")

    return guard(app, token_env, limits.max_body_bytes)


def serve_retriever(
    index: CorpusIndex,
    host: str = "127.0.0.1",
    port: int = 8000,
    token_env: str = RETRIEVER_TOKEN_ENV,
    limits: RequestLimits = RequestLimits(),
    default_topk: int = 3,
) -> None:
    """Build ``index`` (index the corpus, or load its prebuilt index) and serve it until interrupted. ``port=0`` picks
    a free port (printed). When the variable ``token_env`` is set, requests need its token; ``limits`` bound each
    request."""
    started = time.perf_counter()
    retriever = index.build()
    app = create_app(retriever, limits, token_env, default_topk)
    secured = ", bearer token required" if app.requires_token else ""
    announcement = (f"retriever listening on {{url}} ({len(retriever.corpus)} documents, {index.describe()}{secured}; "
                    f"ready in {time.perf_counter() - started:.1f} s)")
    serve_app(app, host, port, announcement)


def serve_from_args(args: argparse.Namespace) -> None:
    """``serve_retriever`` with the options of ``add_retriever_server_arguments``."""
    limits = RequestLimits(args.max_body_bytes, args.max_queries, args.max_query_chars, args.max_topk)
    prebuilt = None
    if args.index:
        if args.backend not in (None, "dense"):
            raise SystemExit(f"--index serves a prebuilt dense index: --backend {args.backend} cannot use it")
        prebuilt = PrebuiltIndex(args.index, args.encoder_family, args.pooling, args.query_prefix, args.faiss_gpu,
                                 SearchWidth(args.nprobe, args.efSearch), args.encoder_device)
    try:
        serve_retriever(CorpusIndex.from_args(args, prebuilt), host=args.host, port=args.port, token_env=args.token_env,
                        limits=limits, default_topk=args.topk)
    except (ValueError, FileNotFoundError) as error:  # a set-up problem: the message says what to give
        raise SystemExit(f"serve-retriever: {type(error).__name__}: {error}") from error


def main() -> None:
    run_server("Serve retrieval over a JSONL corpus (Search-R1 API).", add_retriever_server_arguments, serve_from_args)


if __name__ == "__main__":
    main()
