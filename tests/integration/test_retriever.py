import json
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
from threaded_server import closed_port, scripted_retriever

from rlsearch.config import RetrieverConfig, ToolsConfig
from rlsearch.tools import (
    BM25Retriever,
    ErrorKind,
    RetrievalClient,
    RetrieverProcess,
    SearchTool,
    ToolCall,
    ToolError,
    ToolServers,
    ToolSetupError,
    build_registry,
)

UNIQUE_PASSAGES = {
    "quokkafish": {"id": "unique-0", "contents": '"Quokkafish"\nThe quokkafish is a reef fish that smiles.'},
    "zirconlamp": {"id": "unique-1", "contents": '"Zircon lamp"\nA zirconlamp burns with a blue flame.'},
    "vellichor": {"id": "unique-2", "contents": '"Vellichor"\nVellichor is the mood of used bookshops.'},
}
FILLER_TOPICS = ["river", "mountain", "harbor", "desert", "forest", "island", "valley", "glacier", "canyon"]


def corpus_records() -> list[dict]:
    filler = [
        {
            "id": f"filler-{i}",
            "contents": f'"Place {i}"\nThis passage describes a {FILLER_TOPICS[i % 9]} near town number {i}.',
        }
        for i in range(27)
    ]
    return filler[:10] + list(UNIQUE_PASSAGES.values()) + filler[10:]


@pytest.fixture(scope="module")
def corpus_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in corpus_records()))
    return path


@pytest.fixture(scope="module")
def server(corpus_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RetrieverProcess]:
    with RetrieverProcess(str(corpus_path), cache_dir=str(tmp_path_factory.mktemp("cache"))) as process:
        yield process


def post_retrieve(server: RetrieverProcess, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/retrieve", json=body, timeout=10.0)


def test_server_binds_loopback_on_a_chosen_port(server: RetrieverProcess) -> None:
    address = urlparse(server.url)
    assert address.hostname == "127.0.0.1"
    assert address.port == server.port > 0


def test_health_reports_document_count(server: RetrieverProcess) -> None:
    response = httpx.get(f"{server.url}/health", timeout=10.0)
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "num_documents": 30}


def test_unique_word_ranks_its_passage_first(server: RetrieverProcess) -> None:
    response = post_retrieve(server, {"queries": list(UNIQUE_PASSAGES), "topk": 3})
    assert response.status_code == 200
    result = response.json()["result"]
    assert [hits[0] for hits in result] == list(UNIQUE_PASSAGES.values())
    # Only the unique passage shares a term with each query.
    assert [len(hits) for hits in result] == [1, 1, 1]


def test_return_scores_shape_is_best_first(server: RetrieverProcess) -> None:
    body = {"queries": ["mountain town", "vellichor"], "topk": 5, "return_scores": True}
    result = post_retrieve(server, body).json()["result"]
    assert [len(hits) for hits in result] == [5, 1]
    assert all(set(hit) == {"document", "score"} for hits in result for hit in hits)
    mountain_hits = result[0]
    assert all("mountain" in hit["document"]["contents"] for hit in mountain_hits[:3])
    scores = [hit["score"] for hit in mountain_hits]
    assert scores == sorted(scores, reverse=True)
    assert result[1][0]["document"] == UNIQUE_PASSAGES["vellichor"]
    assert result[1][0]["score"] > 0


def test_topk_is_clamped_to_the_corpus_size(server: RetrieverProcess) -> None:
    result = post_retrieve(server, {"queries": ["passage town"], "topk": 100}).json()["result"]
    assert len(result[0]) == 27


def test_empty_query_returns_no_documents(server: RetrieverProcess) -> None:
    result = post_retrieve(server, {"queries": ["", "quokkafish"]}).json()["result"]
    assert result == [[], [UNIQUE_PASSAGES["quokkafish"]]]


@pytest.mark.parametrize(
    "body",
    [
        {"queries": ["river"], "topk": 0},
        {"queries": ["river"], "topk": 101},
        {"queries": "river"},
        {"queries": [1, 2]},
        {"topk": 3},
    ],
)
def test_bad_request_is_rejected(server: RetrieverProcess, body: dict) -> None:
    response = post_retrieve(server, body)
    assert response.status_code == 422
    assert response.json()["detail"]


def test_client_returns_the_same_top_documents(server: RetrieverProcess) -> None:
    client = RetrievalClient(server.url, topk=3)
    try:
        contents = client.retrieve(list(UNIQUE_PASSAGES))
    finally:
        client.close()
    assert contents == [[passage["contents"]] for passage in UNIQUE_PASSAGES.values()]
    assert (client.num_requests, client.num_retries, client.num_failures) == (1, 0, 0)


def test_client_skips_the_request_for_no_queries() -> None:
    client = RetrievalClient(f"http://127.0.0.1:{closed_port()}")
    assert client.retrieve([]) == []
    assert client.num_requests == 0
    client.close()


def test_index_is_reloaded_from_cache(corpus_path: Path, tmp_path: Path) -> None:
    first = BM25Retriever.from_corpus(corpus_path, cache_dir=tmp_path)
    second = BM25Retriever.from_corpus(corpus_path, cache_dir=tmp_path)
    assert (first.loaded_from_cache, second.loaded_from_cache) == (False, True)
    queries = ["zirconlamp", "glacier town"]
    assert second.search(queries, 4) == first.search(queries, 4)


def test_changed_corpus_is_not_served_from_a_stale_cache(corpus_path: Path, tmp_path: Path) -> None:
    BM25Retriever.from_corpus(corpus_path, cache_dir=tmp_path)
    changed_corpus = tmp_path / "changed.jsonl"
    changed_corpus.write_text(corpus_path.read_text() + json.dumps({"id": "new", "contents": "x"}) + "\n")
    changed = BM25Retriever.from_corpus(changed_corpus, cache_dir=tmp_path)
    assert changed.loaded_from_cache is False
    assert changed.num_documents == 31


def test_dead_server_raises_after_bounded_retries() -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    client = RetrievalClient(url, timeout_s=1.0, max_retries=3, backoff_s=0.01)
    expected_message = f"{url}/retrieve failed after 4 attempts; last error: ConnectError"
    with pytest.raises(ToolError, match=re.escape(expected_message)):
        client.retrieve(["river"])
    assert (client.num_requests, client.num_retries, client.num_failures) == (1, 3, 1)
    client.close()


def install_mock_server(client: RetrievalClient, statuses: list[int]) -> list[httpx.Request]:
    """Answers the client's requests with the given statuses in turn; returns the requests received."""
    received: list[httpx.Request] = []

    def respond(request: httpx.Request) -> httpx.Response:
        received.append(request)
        status = statuses[len(received) - 1]
        body = {"result": [[{"id": "1", "contents": "doc"}]]} if status == 200 else {"detail": "boom"}
        return httpx.Response(status, json=body)

    client._http.close()
    client._http = httpx.Client(transport=httpx.MockTransport(respond))
    return received


def test_client_retries_server_errors_then_succeeds() -> None:
    client = RetrievalClient("http://retriever.test", max_retries=3, backoff_s=0.0)
    received = install_mock_server(client, [503, 500, 200])
    assert client.retrieve(["q"]) == [["doc"]]
    assert len(received) == 3
    assert json.loads(received[0].content) == {"queries": ["q"], "topk": 3, "return_scores": False}
    assert (client.num_requests, client.num_retries, client.num_failures) == (1, 2, 0)


def test_client_does_not_retry_a_rejected_request() -> None:
    client = RetrievalClient("http://retriever.test", max_retries=3, backoff_s=0.0)
    received = install_mock_server(client, [422])
    with pytest.raises(ToolError, match=re.escape("http://retriever.test/retrieve rejected: HTTP 422")):
        client.retrieve(["q"])
    assert len(received) == 1
    assert (client.num_retries, client.num_failures) == (0, 1)


def test_process_that_dies_on_startup_reports_its_log(tmp_path: Path) -> None:
    process = RetrieverProcess(str(tmp_path / "missing.jsonl"), cache_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 1 on startup.*FileNotFoundError"):
        process.start()


def test_search_tool_honours_topk_and_rejects_unknown_attributes(server: RetrieverProcess) -> None:
    tool = SearchTool(RetrievalClient(server.url, topk=2, batch_size=2))
    calls = [
        ToolCall("search", "mountain town"), ToolCall("search", "river town", {"topk": "5"}),
        ToolCall("search", "quokkafish"), ToolCall("search", "x", {"topk": "0"}), ToolCall("search", "x", {"k": "1"}),
    ]
    results = tool.run_batch(calls)
    assert [len(r.documents) for r in results[:3]] == [2, 5, 1]
    assert results[2].documents[0].id == "unique-0" and results[2].documents[0].title == '"Quokkafish"'
    assert [r.error_kind for r in results[3:]] == [ErrorKind.TOOL_ERROR] * 2
    assert "topk must be an integer from 1 to 100; got '0'" in results[3].error
    assert "no parameter 'k'" in results[4].error
    assert tool.stats() == {"requests": 2, "retries": 0, "failures": 0}  # one request per topk
    tool.close()


GOOD_REPLY = (200, {"result": [[{"id": "7", "contents": '"Title"\nbody'}]]})
MALFORMED_REPLY = (200, {"result": [[{"id": "7", "contents": 12345}]]})


def remote_search(url: str, enabled: tuple[str, ...] = ("search",)) -> ToolsConfig:
    return ToolsConfig(enabled=list(enabled), retriever=RetrieverConfig(url=url, max_retries=1, backoff_s=0.01))


def test_a_malformed_reply_is_a_failure_of_the_server_naming_the_field() -> None:
    with scripted_retriever([MALFORMED_REPLY]) as url:
        registry = build_registry(ToolsConfig(), RetrieverConfig(max_retries=0), url)
        (result,) = registry.run([ToolCall("search", "river")])
        registry.close()
    assert result.error_kind is ErrorKind.TOOL_ERROR and result.unavailable
    assert result.error.startswith(f"{url}/retrieve returned a malformed reply: result[0][0].contents is 12345, not "
                                   "text; Search-R1's /retrieve API answers")


def test_a_remote_retriever_must_answer_a_search_at_start_up() -> None:
    dead = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(ToolSetupError) as stopped:
        ToolServers(remote_search(dead)).start()
    assert str(stopped.value).startswith(
        f"'tools.retriever.url' is {dead}, but a test search there failed: {dead}/retrieve failed after 2 attempts; "
        "last error: ConnectError")
    assert str(stopped.value).endswith(
        "Start the retriever (rlsearch serve-retriever --corpus CORPUS --port PORT), fix tools.retriever.url, or leave "
        "it empty for the run to start one over tools.retriever.corpus")
    with scripted_retriever([MALFORMED_REPLY]) as url, pytest.raises(ToolSetupError, match="malformed reply"):
        ToolServers(remote_search(url)).start()
    with ToolServers(remote_search(dead, enabled=())):  # a run without search does not need it
        pass
    # a server just starting (503 first), without /health: the retries reach it
    with scripted_retriever([(503, {"detail": "starting"}), GOOD_REPLY]) as url, \
            ToolServers(remote_search(url)) as servers:
        assert servers.tools.retriever.url == url and servers.retriever is None
