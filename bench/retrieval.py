"""Retrieval throughput over HTTP against in-process bm25s, and dense vs BM25 recall on the toy data.

Throughput: the same queries (toy questions, repeated) are searched
  in-process : BM25Retriever.search over all queries in one call (bm25s, no HTTP)
  http       : the retrieval server (`rlsearch serve-retriever`, BM25) through the batched RetrievalClient
               (requests of --batch-size queries, --concurrency in flight; the server merges concurrent requests)
Recall@5: the share of toy questions whose gold passage is among the top 5, for bm25, dense (all-MiniLM-L6-v2 +
faiss) and hybrid (reciprocal rank fusion), on the default toy data (200 entities, 600 passages).
The last line is the figure: http queries/s / in-process queries/s (goal >= 0.8).

  .venv/bin/python bench/retrieval.py                      # 3000-entity corpus (9000 passages), 4096 queries
  .venv/bin/python bench/retrieval.py --entities 500 --queries 1024 --skip-dense   # quick run
"""

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entities", type=int, default=3000, help="toy entities of the corpus (3 passages each)")
    parser.add_argument("--queries", type=int, default=4096)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="queries per client request")
    parser.add_argument("--concurrency", type=int, default=4, help="client requests in flight")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side; the best counts")
    parser.add_argument("--skip-dense", action="store_true", help="no recall comparison (no MiniLM encoding)")
    args = parse_args(parser, dict(entities=100, queries=64, repeats=1, skip_dense=True))

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

    print(f"http queries/s / in-process bm25s queries/s (goal >= 0.8): {http_qps / local_qps:.2f}")


if __name__ == "__main__":
    main()
