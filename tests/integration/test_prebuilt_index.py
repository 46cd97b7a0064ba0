"""A prebuilt FAISS index served as it is (``serve-retriever --index``, Search-R1's flags): Flat, IVF and HNSW indexes
built with faiss directly over a generated corpus and the local sentence-transformers encoder answer /retrieve with
the ids and scores faiss gives for the same encoder; a 500k-line corpus is served without being read into memory;
an index that does not match its encoder or its corpus is refused at start-up naming both files."""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import numpy as np
import pytest
from threaded_server import serve_in_thread

from rlsearch.tools import RetrieverProcess
from rlsearch.tools.servers.dense import default_encoder_path
from rlsearch.tools.servers.options import add_retriever_server_arguments
from rlsearch.tools.servers.prebuilt import (
    EncoderSettings,
    PrebuiltIndexRetriever,
    SearchWidth,
    encoder_device,
    gpu_refusal,
    read_index,
)
from rlsearch.tools.servers.retrieval import create_app

PREFIX = "search for: "  # a query prefix of our own: the server must put it where the reference does
WORDS = ("river harbour castle meadow glacier violin copper lantern orchard falcon desert library tunnel festival "
         "engine quarry monastery canyon bakery comet").split()
QUERIES = ["a castle by the river", "copper engine in a tunnel", "festival with violin music", "comet over the desert",
           "old monastery library", ""]


@pytest.fixture(scope="module")
def encoder_path() -> str:
    return default_encoder_path()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("prebuilt") / "corpus.jsonl"
    rows = [{"id": str(i), "contents": f'"Doc {i}"\n' + " ".join(rng.choices(WORDS, k=12))} for i in range(160)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def indexes(corpus, encoder_path) -> dict[str, Path]:
    """Flat, IVF and HNSW inner-product indexes of the passages' embeddings, built the way Search-R1's
    index_builder.py builds them (faiss.index_factory, METRIC_INNER_PRODUCT)."""
    import faiss
    from sentence_transformers import SentenceTransformer

    contents = [json.loads(line)["contents"] for line in corpus.read_text().splitlines()]
    vectors = SentenceTransformer(encoder_path, device="cpu").encode(contents, normalize_embeddings=True)
    built = {}
    for name, spec in (("flat", "Flat"), ("ivf", "IVF4,Flat"), ("hnsw", "HNSW16"), ("ivf16", "IVF16,Flat")):
        index = faiss.index_factory(vectors.shape[1], spec, faiss.METRIC_INNER_PRODUCT)
        index.train(vectors)
        index.add(vectors)
        if name == "ivf":
            index.nprobe = 2  # stored in the file: the server searches with it as faiss does
        built[name] = corpus.with_name(f"minilm_{spec.replace(',', '_')}.index")
        faiss.write_index(index, str(built[name]))
    return built


def faiss_directly(index_path: Path, encoder_path: str, queries: list[str], prefix: str, topk: int = 3):
    """(ids, scores) per query: the reference encoder (sentence-transformers) and faiss, no rlsearch code."""
    import faiss
    from sentence_transformers import SentenceTransformer

    index = faiss.read_index(str(index_path))
    encoder = SentenceTransformer(encoder_path, device="cpu")
    vectors = encoder.encode([prefix + q for q in queries], normalize_embeddings=True)
    scores, rows = index.search(np.ascontiguousarray(vectors, dtype=np.float32), topk)
    return [[str(row) for row in hits] for hits in rows.tolist()], scores.tolist()


def retrieve(url: str, queries: list[str], topk: int | None = 3) -> tuple[list[list[str]], list[list[float]]]:
    body = {"queries": queries, "return_scores": True, **({"topk": topk} if topk else {})}
    result = httpx.post(f"{url}/retrieve", json=body, timeout=60).raise_for_status().json()["result"]
    return ([[hit["document"]["id"] for hit in hits] for hits in result],
            [[hit["score"] for hit in hits] for hits in result])


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_prebuilt_index_answers_with_the_ids_and_scores_of_faiss_directly(kind, indexes, corpus, encoder_path):
    settings = EncoderSettings(encoder_path, pooling="mean", query_prefix=PREFIX)
    retriever = PrebuiltIndexRetriever.load(indexes[kind], corpus, settings)
    with serve_in_thread(create_app(retriever)) as url:
        ids, scores = retrieve(url, QUERIES)
        document = httpx.post(f"{url}/retrieve", json={"queries": [QUERIES[0]], "topk": 1}).json()["result"][0][0]
    expected_ids, expected_scores = faiss_directly(indexes[kind], encoder_path, QUERIES[:-1], PREFIX)
    assert ids[:-1] == expected_ids and ids[-1] == []  # an empty query gets no passages
    np.testing.assert_allclose(np.array(scores[:-1]), np.array(expected_scores), atol=2e-5)
    row = json.loads(corpus.read_text().splitlines()[int(expected_ids[0][0])])
    assert document == {"id": row["id"], "contents": row["contents"]}
    # without the prefix the vectors differ: the prefix is what the server used
    assert faiss_directly(indexes[kind], encoder_path, QUERIES[:1], "")[1] != expected_scores[:1]


def test_search_r1_command_line_serves_a_prebuilt_index(indexes, corpus, encoder_path, tmp_path):
    """retrieval_server.py's flags as they are (--retriever_name e5: the "query: " prefix); --faiss_gpu without
    GPU faiss searches on the CPU."""
    arguments = ["--index_path", str(indexes["flat"]), "--corpus_path", str(corpus), "--topk", "2",
                 "--retriever_name", "e5", "--retriever_model", encoder_path, "--faiss_gpu"]
    import argparse

    parsed = argparse.ArgumentParser()
    add_retriever_server_arguments(parsed)
    args = parsed.parse_args(arguments)
    assert (args.index, args.corpus, args.topk, args.encoder_family, args.encoder, args.faiss_gpu) == (
        str(indexes["flat"]), str(corpus), 2, "e5", encoder_path, True)
    # RetrieverProcess gives the corpus itself; the rest is Search-R1's command
    server = RetrieverProcess(str(corpus), cache_dir=str(tmp_path), backend="dense",
                              extra_arguments=arguments[:2] + arguments[4:])
    with server:
        ids, scores = retrieve(server.url, QUERIES[:3], topk=None)  # no topk: the server's --topk
        log = server.log_path.read_text()
    expected_ids, expected_scores = faiss_directly(indexes["flat"], encoder_path, QUERIES[:3], "query: ", topk=2)
    assert ids == expected_ids
    np.testing.assert_allclose(np.array(scores), np.array(expected_scores), atol=2e-5)
    assert "searching on the CPU" in log and "160 documents, dense, index" in log


def test_mismatched_index_encoder_and_corpus_are_refused_at_start_up_naming_both_files(
        indexes, corpus, encoder_path, tmp_path):
    import faiss

    short = tmp_path / "short.jsonl"
    short.write_text("\n".join(corpus.read_text().splitlines()[:-1]) + "\n")
    with pytest.raises(ValueError, match=rf"the index {indexes['flat']} holds 160 vectors but the corpus {short} "
                                         "has 159 passages"):
        PrebuiltIndexRetriever.load(indexes["flat"], short, EncoderSettings(encoder_path))
    narrow = tmp_path / "narrow.index"
    index = faiss.IndexFlatIP(8)
    index.add(np.random.default_rng(0).random((160, 8), dtype=np.float32))
    faiss.write_index(index, str(narrow))
    with pytest.raises(ValueError, match=rf"the index {narrow} holds 8-dimensional vectors but the encoder "
                                         rf"{encoder_path} makes 384-dimensional ones"):
        PrebuiltIndexRetriever.load(narrow, corpus, EncoderSettings(encoder_path))


def test_a_500k_line_corpus_is_served_without_reading_it_into_memory(tmp_path, encoder_path):
    """Random vectors (this tests memory, not the encoder) in a Flat index of a tiny random-init BERT's width; the
    corpus file is ~150 MB, the server's memory grows by the index and the line offsets (8 bytes a line) only."""
    import faiss
    import psutil
    from transformers import AutoTokenizer, BertConfig, BertModel

    tiny = tmp_path / "tiny-encoder"
    config = BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=16)
    BertModel(config).save_pretrained(tiny)
    AutoTokenizer.from_pretrained(encoder_path).save_pretrained(tiny)
    lines = 500_000
    filler = "lorem ipsum dolor sit amet " * 9
    corpus = tmp_path / "big.jsonl"
    with corpus.open("w") as handle:
        handle.writelines(f'{{"id": "p{i}", "contents": "\\"Passage {i}\\"\\n{filler}{i}"}}\n' for i in range(lines))
    index = faiss.IndexFlatIP(8)
    index.add(np.random.default_rng(0).random((lines, 8), dtype=np.float32))
    faiss.write_index(index, str(tmp_path / "big.index"))
    del index
    settings = EncoderSettings(str(tiny), pooling="mean")
    PrebuiltIndexRetriever.load(tmp_path / "big.index", corpus, settings, cache_dir=tmp_path)  # offsets built
    process = psutil.Process()
    before = process.memory_info().rss
    retriever = PrebuiltIndexRetriever.load(tmp_path / "big.index", corpus, settings, cache_dir=tmp_path)
    hits = retriever.search([f"query {i}" for i in range(64)], 3)
    last = retriever.corpus.document(lines - 1)
    growth = process.memory_info().rss - before
    corpus_bytes = corpus.stat().st_size
    assert len(retriever.corpus) == lines and last["id"] == f"p{lines - 1}"
    assert last["contents"].endswith(filler + "499999")
    assert all(len(query_hits) == 3 for query_hits in hits)
    index_and_offsets = (tmp_path / "big.index").stat().st_size + 8 * lines
    print(f"\ncorpus {corpus_bytes / 2**20:.0f} MiB, RSS growth {growth / 2**20:.1f} MiB "
          f"(index + offsets {index_and_offsets / 2**20:.1f} MiB)")
    assert growth < corpus_bytes / 4
    assert Path(f"{corpus}.offsets.npy").is_file()  # cached beside the corpus: the next start reads no line


def recall_against_flat(retriever: PrebuiltIndexRetriever, flat: PrebuiltIndexRetriever, queries: list[str],
                        topk: int = 10) -> float:
    """The fraction of the Flat index's top ``topk`` passages (the exact ones) that ``retriever`` finds too."""
    found = [{hit["id"] for hit, _ in hits} for hits in retriever.search(queries, topk)]
    exact = [{hit["id"] for hit, _ in hits} for hits in flat.search(queries, topk)]
    return sum(len(a & b) for a, b in zip(found, exact)) / sum(len(b) for b in exact)


def test_search_width_nprobe_and_efsearch_raise_recall_to_the_flat_indexs_and_are_said(
        indexes, corpus, encoder_path, capsys):
    """An IVF index searched with faiss's default nprobe (1 of 16 lists) misses most of what the Flat index finds;
    --nprobe 16 visits every list and finds all of it. Each start says what it searches with."""
    settings = EncoderSettings(encoder_path, pooling="mean")
    queries = [f"{a} {b}" for a, b in zip(WORDS, WORDS[7:] + WORDS[:7])]
    flat = PrebuiltIndexRetriever.load(indexes["flat"], corpus, settings)
    capsys.readouterr()
    narrow = PrebuiltIndexRetriever.load(indexes["ivf16"], corpus, settings)
    assert f"{indexes['ivf16']} is searched with nprobe=1 of 16 lists (the index file's;" in capsys.readouterr().out
    wide = PrebuiltIndexRetriever.load(indexes["ivf16"], corpus, settings, width=SearchWidth(nprobe=16))
    assert capsys.readouterr().out == f"[rlsearch] {indexes['ivf16']} is searched with nprobe=16 of 16 lists\n"
    assert recall_against_flat(narrow, flat, queries) < 0.5
    assert recall_against_flat(wide, flat, queries) == 1.0
    hnsw = PrebuiltIndexRetriever.load(indexes["hnsw"], corpus, settings, width=SearchWidth(efSearch=160))
    assert capsys.readouterr().out == f"[rlsearch] {indexes['hnsw']} is searched with efSearch=160\n"
    assert recall_against_flat(hnsw, flat, queries) == 1.0
    # an option the index has no use for is refused, naming it and the one it takes
    with pytest.raises(ValueError, match=rf"--nprobe \(tools.retriever.nprobe\) applies to an IVF index, and "
                                         rf"{indexes['hnsw']} is an IndexHNSWFlat; this one takes --efSearch"):
        read_index(indexes["hnsw"], width=SearchWidth(nprobe=8))


def test_faiss_gpu_and_the_encoder_device_are_decided_from_the_devices_given(indexes):
    """No GPU here: the decisions take the device facts (faiss's GPU count, torch's visible GPUs) as arguments. An
    HNSW index, which faiss cannot put on a GPU, stays on the CPU with a reason; the encoder goes where it is told,
    and the server a run starts is told cpu (Ray puts the run's ranks and engines on the GPUs from cuda:0 up)."""
    from rlsearch.config import RetrieverConfig
    from rlsearch.tools.launch.local import _index_arguments

    assert gpu_refusal(read_index(indexes["flat"]), gpus=2) == gpu_refusal(read_index(indexes["ivf"]), gpus=2) == ""
    assert gpu_refusal(read_index(indexes["hnsw"]), gpus=2) == (
        "faiss cannot put an IndexHNSWFlat on a GPU (it takes Flat, IVF-Flat, IVF-PQ and IVF-SQ indexes)")
    assert gpu_refusal(read_index(indexes["flat"]), gpus=0).startswith("this faiss has no GPU support")
    assert [encoder_device(device, visible) for device, visible in
            (("auto", 0), ("auto", 2), ("cpu", 2), ("cuda", 1), ("cuda:1", 2))] == ["cpu", "cuda", "cpu", "cuda",
                                                                                      "cuda:1"]
    for device, visible, error in (("cuda:2", 2, "sees 2 GPU\\(s\\), cuda:0 to cuda:1"), ("cuda", 0, "sees no GPU"),
                                   ("gpu", 1, "must be auto, cpu, cuda or cuda:N")):
        with pytest.raises(ValueError, match=error):
            encoder_device(device, visible)
    run_started = RetrieverConfig(index="e5_Flat.index", encoder="e5", backend="dense", nprobe=64)
    assert _index_arguments(run_started) == ["--index", "e5_Flat.index", "--nprobe=64", "--encoder-device=cpu"]
