"""A prebuilt FAISS index served as it is: Search-R1's e5_Flat.index over wiki-18.jsonl, or any index (Flat, IVF, HNSW,
PQ) whose rows are the lines of a JSONL corpus, searched with the query embeddings of the encoder it was built with.

The encoder is any HuggingFace encoder (AutoModel + AutoTokenizer) with Search-R1's conventions (retrieval_server.py,
index_builder.py): a query prefix ("query: " for e5, bge's instruction), pooling (mean, cls or the model's pooler
output) and L2 normalisation (all but dpr). The index is memory-mapped where faiss can (flat codes), so start-up does
not read it whole; the corpus is read one passage per hit (`LineCorpus`). A mismatch of the index with the encoder
(dimension) or with the corpus (rows) is refused at start-up naming both files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .corpus import Hits, LineCorpus

QUERY_MAX_TOKENS = 256  # Search-R1's retrieval_query_max_length
ENCODE_BATCH_SIZE = 64
BGE_INSTRUCTION = "Represent this sentence for searching relevant passages: "
POOLINGS = ("mean", "cls", "pooler")


@dataclass(frozen=True)
class EncoderFamily:
    query_prefix: str = ""
    pooling: str = "mean"
    normalize: bool = True


# index_builder.py's MODEL2POOLING and retrieval_server.py's prefixes; dpr embeddings are not normalised there
FAMILIES = {
    "e5": EncoderFamily("query: ", "mean"),
    "bge": EncoderFamily(BGE_INSTRUCTION, "cls"),
    "contriever": EncoderFamily("", "mean"),
    "jina": EncoderFamily("", "mean"),
    "dpr": EncoderFamily("", "pooler", normalize=False),
}


@dataclass(frozen=True)
class EncoderSettings:
    """How queries become vectors; `resolve` fills in what the family implies."""

    path: str  # a local dir, or a hub name transformers finds in its cache (HF_HUB_OFFLINE=1 never downloads)
    family: str = ""  # e5, bge, contriever, jina, dpr, or another name (no prefix, mean pooling); empty: from path
    pooling: str = "auto"  # auto (the family's) | mean | cls | pooler
    query_prefix: str | None = None  # None: the family's

    def resolve(self) -> tuple[str, str, bool]:
        """(query prefix, pooling, normalize)."""
        name = (self.family or Path(self.path.rstrip("/")).name).lower()
        family = next((rules for key, rules in FAMILIES.items() if key in name), EncoderFamily())
        pooling = family.pooling if self.pooling in ("", "auto") else self.pooling
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}; got {pooling!r}")
        prefix = family.query_prefix if self.query_prefix is None else self.query_prefix
        return prefix, pooling, family.normalize


class QueryEncoder:
    """Queries -> float32 vectors, batched, as Search-R1's Encoder.encode(is_query=True) computes them."""

    def __init__(self, settings: EncoderSettings) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.settings = settings
        self.prefix, self.pooling, self.normalize = settings.resolve()
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(settings.path)
            model = AutoModel.from_pretrained(settings.path)
        except OSError as error:
            raise FileNotFoundError(
                f"encoder {settings.path!r} cannot be loaded: give the HuggingFace encoder dir the index was built "
                f"with (or a hub name in the local HuggingFace cache). {error}") from error
        # the GPU runs it in float16, as Search-R1's server does; the CPU in float32
        self.model = (model.half() if self.device == "cuda" else model).to(self.device).eval()
        self.dim = int(self.encode(["dimension probe"]).shape[1])

    def encode(self, queries: list[str]) -> np.ndarray:
        import torch

        batches = []
        for start in range(0, len(queries), ENCODE_BATCH_SIZE):
            texts = [self.prefix + query for query in queries[start : start + ENCODE_BATCH_SIZE]]
            inputs = self.tokenizer(texts, max_length=QUERY_MAX_TOKENS, padding=True, truncation=True,
                                    return_tensors="pt").to(self.device)
            with torch.inference_mode():
                output = self.model(**inputs, return_dict=True)
                vectors = _pool(output, inputs["attention_mask"], self.pooling)
                if self.normalize:
                    vectors = torch.nn.functional.normalize(vectors, dim=-1)
            batches.append(vectors.float().cpu().numpy())
        return np.ascontiguousarray(np.concatenate(batches), dtype=np.float32)


def _pool(output, attention_mask, pooling: str):
    if pooling == "mean":
        hidden = output.last_hidden_state.masked_fill(~attention_mask[..., None].bool(), 0.0)
        return hidden.sum(dim=1) / attention_mask.sum(dim=1)[..., None]
    if pooling == "cls":
        return output.last_hidden_state[:, 0]
    if output.pooler_output is None:
        raise ValueError("pooling 'pooler': this encoder has no pooler output; use mean or cls")
    return output.pooler_output


def read_index(path: str | Path, use_gpu: bool = False):
    """The index, memory-mapped where faiss can (flat codes: Flat, PQ, SQ, HNSW's storage); on every GPU faiss sees
    (float16, sharded, as Search-R1 does) with ``use_gpu`` when faiss has GPU support, else on the CPU (said)."""
    import faiss

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"index not found: {path}")
    try:
        index = faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY)
    except RuntimeError as error:
        raise ValueError(f"{path} is not a FAISS index faiss {faiss.__version__} can read: {error}") from error
    if use_gpu:
        gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
        if not gpus:
            print("[rlsearch] --faiss-gpu: this faiss has no GPU support or sees no GPU (faiss-cpu is installed); "
                  "searching on the CPU", flush=True)
            return index
        options = faiss.GpuMultipleClonerOptions()
        options.useFloat16, options.shard = True, True
        index = faiss.index_cpu_to_all_gpus(index, co=options)
    return index


class PrebuiltIndexRetriever:
    """Inner-product search of a prebuilt index; the hit of row i is passage i of the corpus."""

    def __init__(self, corpus: LineCorpus, index, encoder: QueryEncoder) -> None:
        self.corpus = corpus
        self.index = index
        self.encoder = encoder

    @classmethod
    def load(cls, index_path: str | Path, corpus_path: str | Path, encoder: EncoderSettings,
             cache_dir: str | Path | None = None, use_gpu: bool = False) -> PrebuiltIndexRetriever:
        """The index, its corpus and its encoder, checked against each other before anything is served."""
        corpus = LineCorpus.open(corpus_path, cache_dir)
        index = read_index(index_path, use_gpu)
        if index.ntotal != len(corpus):
            raise ValueError(
                f"the index {index_path} holds {index.ntotal} vectors but the corpus {corpus_path} has {len(corpus)} "
                "passages: an index's rows are its corpus's lines, give the corpus it was built from")
        query_encoder = QueryEncoder(encoder)
        if query_encoder.dim != index.d:
            raise ValueError(
                f"the index {index_path} holds {index.d}-dimensional vectors but the encoder {encoder.path} makes "
                f"{query_encoder.dim}-dimensional ones: give the encoder the index was built with")
        return cls(corpus, index, query_encoder)

    def search(self, queries: list[str], topk: int) -> list[Hits]:
        """Best-first (passage, inner product) pairs per query; an empty query gets none."""
        topk = min(topk, len(self.corpus))
        results: list[Hits] = [[] for _ in queries]
        asked = [index for index, query in enumerate(queries) if query.strip()]
        if not asked or topk < 1:
            return results
        scores, rows = self.index.search(self.encoder.encode([queries[i] for i in asked]), topk)
        for position, query_index in enumerate(asked):
            results[query_index] = [
                (self.corpus.document(row), float(score))
                for row, score in zip(rows[position].tolist(), scores[position].tolist())
                if row >= 0
            ]
        return results
