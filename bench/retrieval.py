"""Retrieval throughput over HTTP against in-process bm25s, and dense vs BM25 recall on the toy data.

See docs/benchmarks.md#retrieval."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.common import parse_args  # noqa: E402


def toy_questions(paths) -> list[dict]:
    return [json.loads(line) for path in (paths.train, paths.test) for line in path.open()]


def queries_per_second(search, queries: list[str], repeats: int) -> float:
    search(queries[:64])  # warm-up
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        search(queries)
        best = min(best, time.perf_counter() - started)
    return len(queries) / best


def recall_at_5(retriever, rows: list[dict]) -> float:
    hits = retriever.search([row["question"] for row in rows], 5)
    found = [row["metadata"]["passage_id"] in {str(doc["id"]) for doc, _ in ranked} for row, ranked in zip(rows, hits)]
    return sum(found) / len(rows)


PREBUILT_DIM = 384  # all-MiniLM-L6-v2's width
BATCH_QUERIES = 64
GOAL_START_S, GOAL_RSS_RATIO, GOAL_BATCH_S = 10.0, 1.5, 1.0


def prebuilt_files(root: Path, lines: int) -> tuple[Path, Path]:
    """A corpus of ``lines`` passages and a Flat inner-product index of as many random unit vectors (made once)."""
    import faiss
    import numpy as np

    root.mkdir(parents=True, exist_ok=True)
    corpus, index_path = root / "corpus.jsonl", root / "random_Flat.index"
    if not (corpus.is_file() and index_path.is_file()):
        print(f"writing {lines} passages and a Flat index of {lines} x {PREBUILT_DIM} random vectors in {root} ...",
              flush=True)
        filler = "a passage of an encyclopedia about a river, a town and the people who founded it " * 3
        with corpus.open("w") as handle:
            handle.writelines(json.dumps({"id": str(i), "contents": f'"Entry {i}"\n{filler}{i}'}) + "\n"
                              for i in range(lines))
        index = faiss.IndexFlatIP(PREBUILT_DIM)
        rng = np.random.default_rng(0)
        for start in range(0, lines, 100_000):
            vectors = rng.standard_normal((min(100_000, lines - start), PREBUILT_DIM), dtype=np.float32)
            index.add(vectors / np.linalg.norm(vectors, axis=1, keepdims=True))
        faiss.write_index(index, str(index_path))
    return corpus, index_path


def best_seconds(run, repeats: int) -> float:
    run()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def prebuilt_case(root: Path, lines: int, repeats: int) -> dict[str, float]:
    """Start-up time, RSS and 64-query latency of `serve-retriever --index` over a prebuilt Flat index, and the same
    search with faiss directly."""
    import faiss
    import httpx
    import psutil

    from rlsearch.tools import RetrieverProcess
    from rlsearch.tools.servers.corpus import OFFSETS_SUFFIX
    from rlsearch.tools.servers.dense import default_encoder_path
    from rlsearch.tools.servers.prebuilt import EncoderSettings, QueryEncoder

    corpus, index_path = prebuilt_files(root, lines)
    encoder = default_encoder_path()
    encoder_bytes = sum(path.stat().st_size for path in Path(encoder).glob("*.safetensors"))
    queries = [f"who founded the town on the river number {i}" for i in range(BATCH_QUERIES)]
    Path(f"{corpus}{OFFSETS_SUFFIX}").unlink(missing_ok=True)
    figures = {}
    for start in ("first", "cached"):  # the first start scans the corpus for its line offsets
        server = RetrieverProcess(str(corpus), backend="dense", encoder=encoder,
                                  extra_arguments=["--index", str(index_path)], cache_dir=str(root / "logs"))
        started = time.perf_counter()
        server.start()
        figures[f"start_{start}_s"] = time.perf_counter() - started
        if start == "first":
            server.stop()
    try:
        with httpx.Client(timeout=120) as client:
            def retrieve() -> None:
                client.post(f"{server.url}/retrieve", json={"queries": queries, "topk": 3}).raise_for_status()

            figures["http_batch_s"] = best_seconds(retrieve, repeats)
        figures["server_rss_mib"] = psutil.Process(server.pid).memory_info().rss / 2**20
    finally:
        server.stop()
    # read as the server reads it (memory-mapped): here a Flat index read whole searched 3x slower, 6.5 vs 2.0 s
    index = faiss.read_index(str(index_path), faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY)
    query_encoder = QueryEncoder(EncoderSettings(encoder))
    figures["faiss_batch_s"] = best_seconds(lambda: index.search(query_encoder.encode(queries), 3), repeats)
    figures["files_mib"] = (index_path.stat().st_size + encoder_bytes) / 2**20
    print(f"prebuilt Flat index, {lines} passages ({corpus.stat().st_size / 2**20:.0f} MiB corpus, "
          f"{index_path.stat().st_size / 2**20:.0f} MiB index, {encoder_bytes / 2**20:.0f} MiB encoder):")
    print(f"  serving after      : {figures['start_cached_s']:.1f} s (first start, offsets built: "
          f"{figures['start_first_s']:.1f} s)   goal <= {GOAL_START_S:g} s")
    print(f"  server RSS         : {figures['server_rss_mib']:.0f} MiB = "
          f"{figures['server_rss_mib'] / figures['files_mib']:.2f}x index + encoder   goal < {GOAL_RSS_RATIO:g}x")
    print(f"  {BATCH_QUERIES} queries, top 3 : /retrieve {figures['http_batch_s']:.3f} s, faiss directly "
          f"{figures['faiss_batch_s']:.3f} s ({figures['http_batch_s'] / figures['faiss_batch_s']:.2f}x)   "
          f"goal <= {GOAL_BATCH_S:g} s", flush=True)
    return figures


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entities", type=int, default=3000, help="toy entities of the corpus (3 passages each)")
    parser.add_argument("--queries", type=int, default=4096)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="queries per client request")
    parser.add_argument("--concurrency", type=int, default=4, help="client requests in flight")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side; the best counts")
    parser.add_argument("--skip-dense", action="store_true", help="no recall comparison (no MiniLM encoding)")
    parser.add_argument("--prebuilt", action="store_true", help="only the prebuilt-index case")
    parser.add_argument("--lines", type=int, default=500_000, help="--prebuilt: passages of the corpus")
    parser.add_argument("--out", default="outputs/bench", help="where the prebuilt case's corpus and index are kept")
    # both cases at toy sizes
    return parser


def run(args: argparse.Namespace) -> tuple[float, float]:
    """In-process BM25 against the HTTP server over the same queries (and dense recall@5): (local, http) queries/s."""
    from rlsearch.data import make_toy_data
    from rlsearch.tools import RetrievalClient, RetrieverProcess
    from rlsearch.tools.servers.corpus import Corpus
    from rlsearch.tools.servers.retrieval import BM25Retriever, HybridRetriever

    with tempfile.TemporaryDirectory(prefix="bench-retrieval-") as scratch:
        big = make_toy_data(Path(scratch) / "big", seed=0, num_entities=args.entities)
        questions = [row["question"] for row in toy_questions(big)]
        queries = (questions * (args.queries // len(questions) + 1))[: args.queries]
        corpus = Corpus.read(big.corpus)
        print(f"corpus: {len(corpus)} passages; {len(queries)} queries, top {args.topk}", flush=True)

        in_process = BM25Retriever.build(corpus)
        local_qps = queries_per_second(lambda q: in_process.search(q, args.topk), queries, args.repeats)
        print(f"in-process bm25s           : {local_qps:8.0f} queries/s", flush=True)

        with RetrieverProcess(str(big.corpus), cache_dir=str(Path(scratch) / "cache")) as server:
            client = RetrievalClient(
                server.url, topk=args.topk, batch_size=args.batch_size, max_concurrency=args.concurrency
            )
            http_qps = queries_per_second(client.search, queries, args.repeats)
            client.close()
        print(f"http, batched client       : {http_qps:8.0f} queries/s "
              f"({args.batch_size} queries/request, {args.concurrency} in flight)", flush=True)

        if not args.skip_dense:
            from rlsearch.tools.servers.dense import DenseRetriever

            toy = make_toy_data(Path(scratch) / "toy", seed=0)
            rows, toy_corpus = toy_questions(toy), Corpus.read(toy.corpus)
            bm25 = BM25Retriever.build(toy_corpus)
            started = time.perf_counter()
            dense = DenseRetriever.build(toy_corpus)
            encode_s = time.perf_counter() - started
            print(f"recall@5 on toy data ({len(rows)} questions, {len(toy_corpus)} passages; "
                  f"MiniLM encoded them in {encode_s:.1f} s):")
            for name, retriever in (("bm25", bm25), ("dense", dense), ("hybrid", HybridRetriever(bm25, dense))):
                print(f"  {name:<7}: {recall_at_5(retriever, rows):.3f}", flush=True)
    return local_qps, http_qps


def main() -> None:
    args = parse_args(_parser(), dict(entities=30, queries=128, repeats=1, skip_dense=True, lines=2000))
    if args.prebuilt or args.smoke:
        prebuilt_case(Path(args.out) / f"retrieval-prebuilt-{args.lines}", args.lines, args.repeats)
        if args.prebuilt:
            return

    local_qps, http_qps = run(args)
    print(f"http queries/s / in-process bm25s queries/s (goal >= 0.8): {http_qps / local_qps:.2f}")


if __name__ == "__main__":
    main()
