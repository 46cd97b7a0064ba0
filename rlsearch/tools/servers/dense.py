"""Dense retrieval: a sentence-transformers encoder (all-MiniLM-L6-v2 by default) and an exact faiss index.

Passage embeddings are cached on disk per (encoder, corpus bytes), so a restart only encodes the queries.
"""

from __future__ import annotations

import hashlib
from functools import partial
from pathlib import Path

import numpy as np

from ...config import default_encoder_path
from ...files import atomic_path
from .corpus import Corpus, Hits, search_index

ENCODE_BATCH_SIZE = 64


def load_encoder(path: str = ""):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path or default_encoder_path(), device="cpu")


class DenseRetriever:
    """Inner product over L2-normalised embeddings (cosine similarity), exact search."""

    def __init__(self, corpus: Corpus, encoder, embeddings: np.ndarray, loaded_from_cache: bool) -> None:
        import faiss

        self.corpus = corpus
        self.encoder = encoder
        self.loaded_from_cache = loaded_from_cache
        self._index = faiss.IndexFlatIP(embeddings.shape[1])
        self._index.add(embeddings)

    @classmethod
    def build(cls, corpus: Corpus, cache_dir: str | Path | None = None, encoder_path: str = "") -> DenseRetriever:
        encoder_path = encoder_path or default_encoder_path()
        encoder = load_encoder(encoder_path)
        cache_file = Path(cache_dir) / _cache_name(encoder_path, corpus.digest) if cache_dir else None
        if cache_file is not None and cache_file.is_file():
            return cls(corpus, encoder, np.load(cache_file), loaded_from_cache=True)
        embeddings = _encode(encoder, corpus.contents)
        if cache_file is not None:
            _save_atomically(embeddings, cache_file)
        return cls(corpus, encoder, embeddings, loaded_from_cache=False)

    def search(self, queries: list[str], topk: int) -> list[Hits]:
        return search_index(self._index, self.corpus, partial(_encode, self.encoder), queries, topk)


def _encode(encoder, texts: list[str]) -> np.ndarray:
    embeddings = encoder.encode(
        texts, batch_size=ENCODE_BATCH_SIZE, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
    )
    return np.ascontiguousarray(embeddings, dtype=np.float32)


def _cache_name(encoder_path: str, corpus_digest: str) -> str:
    encoder_tag = hashlib.sha256(str(Path(encoder_path).resolve()).encode()).hexdigest()[:12]
    return f"dense-{Path(encoder_path).name}-{encoder_tag}-{corpus_digest}.npy"


def _save_atomically(embeddings: np.ndarray, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(target) as staging, staging.open("wb") as staging_file:
        np.save(staging_file, embeddings)
