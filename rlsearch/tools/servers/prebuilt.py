"""A prebuilt FAISS index served as it is: Search-R1's e5_Flat.index over wiki-18.jsonl, or any index (Flat, IVF, HNSW,
PQ) whose rows are the lines of a JSONL corpus, searched with the query embeddings of the encoder it was built with.
How wide an approximate index searches is faiss's own setting, named as faiss names it (`SearchWidth`: IVF's nprobe,
HNSW's efSearch), the file's unless given, and said at start-up.

The encoder is any HuggingFace encoder (AutoModel + AutoTokenizer) with Search-R1's conventions (retrieval_server.py,
index_builder.py): a query prefix ("query: " for e5, bge's instruction), pooling (mean, cls or the model's pooler
output) and L2 normalisation (all but dpr). The index is memory-mapped where faiss can (flat codes), so start-up does
not read it whole; the corpus is read one passage per hit (`LineCorpus`). A mismatch of the index with the encoder
(dimension) or with the corpus (rows) is refused at start-up naming both files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .corpus import Hits, LineCorpus, search_index

QUERY_MAX_TOKENS = 256  # Search-R1's retrieval_query_max_length
ENCODE_BATCH_SIZE = 64
BGE_INSTRUCTION = "Represent this sentence for searching relevant passages: "
POOLINGS = ("mean", "cls", "pooler")
ENCODER_DEVICE = re.compile(r"auto|cpu|cuda(?::(\d+))?")


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
    device: str = "auto"  # auto (cuda where a GPU is visible) | cpu | cuda | cuda:N: `encoder_device`

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
        self.device = encoder_device(settings.device, torch.cuda.device_count() if torch.cuda.is_available() else 0)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(settings.path)
            model = AutoModel.from_pretrained(settings.path)
        except OSError as error:
            raise FileNotFoundError(
                f"encoder {settings.path!r} cannot be loaded: give the HuggingFace encoder dir the index was built "
                f"with (or a hub name in the local HuggingFace cache). {error}") from error
        # the GPU runs it in float16, as Search-R1's server does; the CPU in float32
        self.model = (model.half() if self.device.startswith("cuda") else model).to(self.device).eval()
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


def encoder_device(requested: str, visible_gpus: int) -> str:
    """The torch device of the query encoder: ``requested`` (--encoder-device) checked against the GPUs this process
    sees. auto is a GPU whenever one is visible, as Search-R1's server does: right for a server on a machine of its
    own, not beside a run's ranks and engines (the server a run starts is given cpu, or the GPU its config names)."""
    match = ENCODER_DEVICE.fullmatch(requested)
    if match is None:
        raise ValueError(f"--encoder-device (tools.retriever.encoder_device) must be auto, cpu, cuda or cuda:N; "
                         f"got {requested!r}")
    if requested == "auto":
        return "cuda" if visible_gpus else "cpu"
    if requested == "cpu":
        return requested
    if not visible_gpus:
        raise ValueError(f"--encoder-device {requested}: this process sees no GPU (a CPU-only torch, or "
                         "CUDA_VISIBLE_DEVICES hides them); give cpu")
    if match[1] is not None and int(match[1]) >= visible_gpus:
        raise ValueError(f"--encoder-device {requested}: this process sees {visible_gpus} GPU(s), cuda:0 to "
                         f"cuda:{visible_gpus - 1} (numbered within CUDA_VISIBLE_DEVICES)")
    return requested


def _pool(output, attention_mask, pooling: str):
    if pooling == "mean":
        hidden = output.last_hidden_state.masked_fill(~attention_mask[..., None].bool(), 0.0)
        return hidden.sum(dim=1) / attention_mask.sum(dim=1)[..., None]
    if pooling == "cls":
        return output.last_hidden_state[:, 0]
    if output.pooler_output is None:
        raise ValueError("pooling 'pooler': this encoder has no pooler output; use mean or cls")
    return output.pooler_output


@dataclass(frozen=True)
class SearchWidth:
    """How much of an approximate index a search visits, named as faiss names it; 0: what the index file stores
    (faiss's defaults: nprobe 1, which for an IVF index of thousands of lists is a fraction of the recall, and
    efSearch 16)."""

    nprobe: int = 0  # IVF: inverted lists visited per query (at most the index's nlist)
    efSearch: int = 0  # HNSW: candidates kept while walking the graph (faiss keeps at least topk)


def set_search_width(index, width: SearchWidth, path: str | Path) -> str:
    """Set ``width`` on ``index`` (an option the index has no use for is refused, naming it); the line that says
    what it searches with ("" for an exact index)."""
    ivf, hnsw = _ivf_of(index), _hnsw_of(index)
    if width.nprobe and ivf is None:
        raise ValueError(_inapplicable("nprobe", "an IVF", path, index, "efSearch" if hnsw is not None else ""))
    if width.efSearch and hnsw is None:
        raise ValueError(_inapplicable("efSearch", "an HNSW", path, index, "nprobe" if ivf is not None else ""))
    said = []
    if ivf is not None:
        ivf.nprobe = width.nprobe or ivf.nprobe
        said.append(f"nprobe={ivf.nprobe} of {ivf.nlist} lists" + ("" if width.nprobe else " (the index file's; "
                    "--nprobe / tools.retriever.nprobe visits more lists for more recall)"))
    if hnsw is not None:
        hnsw.efSearch = width.efSearch or hnsw.efSearch
        said.append(f"efSearch={hnsw.efSearch}" + ("" if width.efSearch else " (the index file's; --efSearch / "
                    "tools.retriever.efSearch keeps more candidates for more recall)"))
    return f"[rlsearch] {path} is searched with {', '.join(said)}" if said else ""


def _inapplicable(option: str, kind: str, path: str | Path, index, other: str) -> str:
    instead = f"; this one takes --{other}" if other else ""
    return (f"--{option} (tools.retriever.{option}) applies to {kind} index, and {path} is an "
            f"{type(_unwrapped(index)).__name__}{instead}: drop it")


def _ivf_of(index):
    import faiss

    try:
        return faiss.extract_index_ivf(index)
    except RuntimeError:  # not an IVF index, nor one wrapped around one
        return None


def _hnsw_of(index):
    """The HNSW graph of an HNSW index (wrapped or not), whose efSearch is its search width; None for others."""
    return getattr(_unwrapped(index), "hnsw", None)


def _gpu_kinds():
    """What faiss's GPU cloner takes (sharded over GPUs); an HNSW graph, PQ or SQ codes without IVF stay on the CPU."""
    import faiss

    return faiss.IndexFlat, faiss.IndexIVFFlat, faiss.IndexIVFPQ, faiss.IndexIVFScalarQuantizer


def gpu_refusal(index, gpus: int) -> str:
    """Why --faiss-gpu leaves ``index`` on the CPU: faiss sees no GPU (``gpus``, faiss.get_num_gpus()), or cannot
    put this kind of index on one; "" when it goes to the GPUs."""
    if not gpus:
        return "this faiss has no GPU support or sees no GPU (faiss-cpu is installed)"
    if not isinstance(_unwrapped(index), _gpu_kinds()):
        return (f"faiss cannot put an {type(_unwrapped(index)).__name__} on a GPU (it takes Flat, IVF-Flat, IVF-PQ and "
                "IVF-SQ indexes)")
    return ""


def _unwrapped(index):
    """The index under faiss's wrappers (a pre-transform such as PCA, an id map)."""
    import faiss

    while isinstance(index, (faiss.IndexPreTransform, faiss.IndexIDMap)):
        index = faiss.downcast_index(index.index)
    return index


def read_index(path: str | Path, use_gpu: bool = False, width: SearchWidth = SearchWidth()):
    """The index, memory-mapped where faiss can (flat codes: Flat, PQ, SQ, HNSW's storage), searched as wide as
    ``width`` says (said); on every GPU faiss sees (float16, sharded, as Search-R1 does) with ``use_gpu`` when faiss
    can put it there, else on the CPU (said)."""
    import faiss

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"index not found: {path}")
    try:
        index = faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY)
    except RuntimeError as error:
        raise ValueError(f"{path} is not a FAISS index faiss {faiss.__version__} can read: {error}") from error
    if line := set_search_width(index, width, path):  # before a GPU copy, which takes the CPU index's nprobe
        print(line, flush=True)
    if not use_gpu:
        return index
    refusal = gpu_refusal(index, faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0)
    if not refusal:
        options = faiss.GpuMultipleClonerOptions()
        options.useFloat16, options.shard = True, True
        try:
            return faiss.index_cpu_to_all_gpus(index, co=options)
        except RuntimeError as error:  # a wrapper or layout the cloner does not take
            refusal = f"faiss could not copy it to the GPUs ({str(error).strip().splitlines()[-1]})"
    print(f"[rlsearch] --faiss-gpu: {refusal}; searching on the CPU", flush=True)
    return index


class PrebuiltIndexRetriever:
    """Inner-product search of a prebuilt index; the hit of row i is passage i of the corpus."""

    def __init__(self, corpus: LineCorpus, index, encoder: QueryEncoder) -> None:
        self.corpus = corpus
        self.index = index
        self.encoder = encoder

    @classmethod
    def load(cls, index_path: str | Path, corpus_path: str | Path, encoder: EncoderSettings,
             cache_dir: str | Path | None = None, use_gpu: bool = False,
             width: SearchWidth = SearchWidth()) -> PrebuiltIndexRetriever:
        """The index, its corpus and its encoder, checked against each other before anything is served."""
        corpus = LineCorpus.open(corpus_path, cache_dir)
        index = read_index(index_path, use_gpu, width)
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
        return search_index(self.index, self.corpus, self.encoder.encode, queries, topk)
