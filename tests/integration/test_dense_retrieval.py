"""Dense (MiniLM + faiss) and hybrid retrieval, the server's micro-batching, and the client's batching."""

import asyncio
import json
import threading
from pathlib import Path

import httpx
import pytest

from rlsearch.tools import RetrievalClient, RetrieverProcess
from rlsearch.tools.servers.corpus import Corpus
from rlsearch.tools.servers.retrieval import BM25Retriever, HybridRetriever, MicroBatcher, build_retriever

PASSAGES = [
    ("cat", "Cats", "The domestic cat is a small carnivorous mammal kept as a pet."),
    ("car", "Automobiles", "A car is a wheeled motor vehicle used for transportation on roads."),
    ("bread", "Bread", "Bread is a staple food prepared by baking a dough of flour and water."),
    ("volcano", "Volcanoes", "A volcano is a rupture in the crust through which lava and ash escape."),
    ("piano", "Piano", "The piano is a keyboard instrument whose strings are struck by hammers."),
    ("moon", "Moon", "The Moon is the natural satellite that orbits the Earth."),
]
# paraphrases that share no content word with their passage: only the dense encoder can match them
PARAPHRASES = {
    "cat": "feline animal people keep at home",
    "car": "automobile for driving on the highway",
    "bread": "baked loaf made from wheat",
    "volcano": "mountain that erupts molten rock",
    "piano": "musical instrument with black and white keys",
    "moon": "what circles our planet at night",
}


@pytest.fixture(scope="module")
def corpus_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dense") / "corpus.jsonl"
    lines = [json.dumps({"id": pid, "contents": f'"{title}"\n{text}'}) for pid, title, text in PASSAGES]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dense-cache")


@pytest.fixture(scope="module")
def dense(corpus_path, cache_dir):
    return build_retriever(corpus_path, "dense", cache_dir)


def top_ids(retriever, queries: list[str], topk: int = 1) -> list[list[str]]:
    return [[str(doc["id"]) for doc, _ in hits] for hits in retriever.search(queries, topk)]


def test_dense_retriever_matches_paraphrases_bm25_cannot(dense, corpus_path) -> None:
    queries = list(PARAPHRASES.values())
    assert top_ids(dense, queries) == [[pid] for pid in PARAPHRASES]
    bm25_hits = top_ids(BM25Retriever.from_corpus(corpus_path), queries)
    assert sum(hits == [pid] for hits, pid in zip(bm25_hits, PARAPHRASES)) <= 2
    scores = [score for _, score in dense.search(["feline animal people keep at home"], 6)[0]]
    assert scores == sorted(scores, reverse=True) and 0 < scores[0] <= 1.0001


def test_dense_embeddings_are_cached_on_disk(dense, corpus_path, cache_dir) -> None:
    assert dense.loaded_from_cache is False
    assert len(list(cache_dir.glob("dense-*.npy"))) == 1
    again = build_retriever(corpus_path, "dense", cache_dir)
    assert again.loaded_from_cache is True
    assert again.search(["baked loaf"], 3) == dense.search(["baked loaf"], 3)


def test_dense_empty_query_gets_no_results(dense) -> None:
    assert [len(hits) for hits in dense.search(["", "moon"], 2)] == [0, 2]


def test_hybrid_fuses_ranks_of_both(dense, corpus_path) -> None:
    hybrid = HybridRetriever(BM25Retriever.from_corpus(corpus_path), dense)
    # an exact keyword (BM25) and a paraphrase (dense) both rank their passage first after fusion
    assert top_ids(hybrid, ["hammers strings keyboard", "what circles our planet at night"]) == [["piano"], ["moon"]]
    (hits,) = hybrid.search(["piano"], 6)
    # reciprocal rank fusion: first in both rankings scores 2 / (60 + 1)
    assert hits[0][0]["id"] == "piano" and hits[0][1] == pytest.approx(2 / 61)


def test_micro_batcher_merges_concurrent_requests(corpus_path) -> None:
    retriever = BM25Retriever.from_corpus(corpus_path)
    calls: list[int] = []
    original = retriever.search

    def counting_search(queries: list[str], topk: int):
        calls.append(len(queries))
        return original(queries, topk)

    retriever.search = counting_search
    queries = [["cat pet"], ["bread flour", "lava"], ["piano"], ["moon earth"]] * 5

    async def run() -> list:
        batcher = MicroBatcher(retriever)
        worker = asyncio.create_task(batcher.run())
        results = await asyncio.gather(*(batcher.search(q, topk) for q, topk in zip(queries, [1, 2] * 10)))
        worker.cancel()
        return results

    results = asyncio.run(run())
    assert sum(calls) == 25 and len(calls) < len(queries)
    for (request, topk, hits) in zip(queries, [1, 2] * 10, results):
        assert hits == [h[:topk] for h in original(request, 2)]


def test_hybrid_server_and_batched_client_over_http(corpus_path, cache_dir) -> None:
    with RetrieverProcess(str(corpus_path), cache_dir=str(cache_dir), backend="hybrid") as server:
        queries = list(PARAPHRASES.values()) * 3
        client = RetrievalClient(server.url, topk=1, batch_size=4, max_concurrency=3)
        results = client.search(queries)
        assert client.num_requests == 5  # 18 queries in requests of at most 4
        assert [[doc["id"] for doc in hits] for hits in results] == [[pid] for pid in PARAPHRASES] * 3
        # many clients at once: every answer is its own, whatever batch the server merged it into
        answers: dict[int, list] = {}

        def ask(index: int) -> None:
            response = httpx.post(f"{server.url}/retrieve", json={"queries": [queries[index]], "topk": 1}, timeout=60)
            answers[index] = [doc["id"] for doc in response.json()["result"][0]]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert [answers[i] for i in range(12)] == [[pid] for pid in PARAPHRASES] * 2
        client.close()


def test_corpus_finds_passages_by_id(corpus_path) -> None:
    corpus = Corpus.read(corpus_path)
    moon = '"Moon"\nThe Moon is the natural satellite that orbits the Earth.'
    assert corpus.find("moon") == {"id": "moon", "contents": moon}
    assert corpus.find("sun") is None
