"""The tool registry (dispatch by name, errors as results, the store and its replay, identical calls in flight),
observation budgets and the tools config."""

import threading
import time

import pytest

from rlsearch.config import ConfigError, TrainConfig, from_dict, validate_train_config
from rlsearch.config.validate import BUILTIN_TOOLS
from rlsearch.rollout.observation import TRUNCATION_MARK, fitted_observation
from rlsearch.tools import (
    CallToolProtocol,
    Document,
    ErrorKind,
    SearchR1Protocol,
    Tool,
    ToolCache,
    ToolCall,
    ToolError,
    ToolRegistry,
    ToolResult,
    ToolSetupError,
    ToolSpec,
    ToolTimeout,
    make_protocol,
)
from rlsearch.tools.base import PerCallTool
from rlsearch.tools.clients.build import _BUILDERS
from tests.concurrency import InFlight


class EchoTool(Tool):
    """Answers every call with one document repeating the query; counts its batches."""

    def __init__(self, name: str = "echo") -> None:
        self.spec = ToolSpec(name, "repeats the query")
        self.batches: list[list[str]] = []

    def run_batch(self, calls: list[ToolCall]) -> list[ToolResult]:
        self.batches.append([c.query for c in calls])
        return [ToolResult(documents=[Document(text=f"{c.query} {c.attrs}")]) for c in calls]


class FailingTool(PerCallTool):
    """Raises what the query names: a timeout, a tool error, or an unexpected exception."""

    def __init__(self) -> None:
        super().__init__(ToolSpec("flaky", "fails on purpose"), max_concurrency=2)

    def call(self, call: ToolCall) -> list[Document]:
        errors = {"timeout": ToolTimeout("took too long"), "error": ToolError("server said no"), "bug": KeyError("k")}
        raise errors[call.query]


class BrokenBatchTool(Tool):
    spec = ToolSpec("broken", "returns the wrong number of results")

    def run_batch(self, calls: list[ToolCall]) -> list[ToolResult]:
        return []


def test_registry_dispatches_by_name_and_batches_per_tool() -> None:
    echo, other = EchoTool(), EchoTool("other")
    registry = ToolRegistry([echo, other])
    calls = [ToolCall("echo", "a"), ToolCall("other", "b"), ToolCall("echo", "c", {"k": "v"})]
    results = registry.run(calls)
    assert [r.documents[0].text for r in results] == ["a {}", "b {}", "c {'k': 'v'}"]
    assert echo.batches == [["a", "c"]] and other.batches == [["b"]]
    assert all(r.ok and r.latency_s >= 0 for r in results)
    registry.close()


def test_registry_turns_every_failure_into_a_result_of_its_kind() -> None:
    registry = ToolRegistry([FailingTool(), BrokenBatchTool()])
    calls = [ToolCall("flaky", q) for q in ("timeout", "error", "bug")]
    calls += [ToolCall("nope", "x"), ToolCall("broken", "y")]
    results = registry.run(calls)
    assert [r.error_kind for r in results] == [
        ErrorKind.TIMEOUT, ErrorKind.TOOL_ERROR, ErrorKind.TOOL_ERROR, ErrorKind.UNKNOWN_TOOL, ErrorKind.TOOL_ERROR,
    ]
    assert results[0].error == "took too long"
    assert results[2].error == "KeyError: 'k'"
    assert results[3].error == "unknown tool 'nope'; available tools: flaky, broken"
    assert results[4].error == "RuntimeError: tool 'broken' returned 0 results for 1 calls"
    registry.close()


def test_registry_refuses_two_tools_with_one_name() -> None:
    with pytest.raises(ToolSetupError, match="two tools are named 'echo'"):
        ToolRegistry([EchoTool(), EchoTool()])


def test_cache_answers_repeated_calls_without_the_tool(tmp_path) -> None:
    echo = EchoTool()
    registry = ToolRegistry([echo, FailingTool()], cache=ToolCache(tmp_path))
    first = registry.run([ToolCall("echo", "q", {"b": "2", "a": "1"}), ToolCall("flaky", "error")])
    # a new registry over the same directory: the call (attributes in any order) is served from disk
    echo_again = EchoTool()
    again = ToolRegistry([echo_again, FailingTool()], cache=ToolCache(tmp_path))
    second = again.run([ToolCall("echo", "q", {"a": "1", "b": "2"}), ToolCall("flaky", "error")])
    assert second[0].cached and not first[0].cached
    assert second[0].documents == first[0].documents
    assert echo_again.batches == []
    assert second[1].error_kind is ErrorKind.TOOL_ERROR  # failures are not cached
    assert (again.cache.hits, again.cache.misses) == (1, 1)
    assert len(list(tmp_path.rglob("*.json"))) == 1


def test_per_call_tool_runs_calls_concurrently() -> None:
    four_at_once = InFlight(meet=4)

    class MeetingTool(PerCallTool):
        def call(self, call: ToolCall) -> list[Document]:
            with four_at_once:
                return [Document(text=call.query)]

    tool = MeetingTool(ToolSpec("meeting", "waits for the other calls"), max_concurrency=4)
    results = tool.run_batch([ToolCall("meeting", str(i)) for i in range(4)])
    assert [r.error for r in results] == [None] * 4
    assert [r.documents[0].text for r in results] == ["0", "1", "2", "3"]
    assert (four_at_once.calls, four_at_once.most) == (4, 4)
    tool.close()


@pytest.mark.parametrize("protocol", [SearchR1Protocol(), CallToolProtocol()], ids=["search_r1", "call_tool"])
def test_observation_budget_cuts_text_but_keeps_closing_tags(protocol, tokenizer) -> None:
    documents = [Document(text="word " * 300, title=f"Doc {i}", id=str(i)) for i in range(3)]
    full = protocol.observation(documents)
    budget = 80
    cut = fitted_observation(protocol, documents, budget, tokenizer).text
    assert len(tokenizer.encode(full)) > 3 * 300
    assert budget - 5 <= len(tokenizer.encode(cut)) <= budget
    closing = "</information>" if protocol.name == "search_r1" else "</snippet>\n</tool_output>"
    assert closing in cut and TRUNCATION_MARK in cut
    assert fitted_observation(protocol, documents, 0, tokenizer) == (full, False)
    assert fitted_observation(protocol, documents, budget, tokenizer).cut  # counted as rollout/truncated/tool_output


def test_observation_budget_cut_inside_a_multibyte_character_drops_it(tokenizer) -> None:
    protocol = CallToolProtocol()
    documents = [Document(text="北京🚀" * 200, id="u")]
    cut = fitted_observation(protocol, documents, 40, tokenizer).text
    assert "\ufffd" not in cut and cut.endswith("</snippet>\n</tool_output>\n")
    assert len(tokenizer.encode(cut)) <= 40


def test_make_protocol_needs_the_tools_its_tags_name() -> None:
    with pytest.raises(ToolSetupError, match="protocol 'search_r1' calls the tool\\(s\\) search"):
        make_protocol("search_r1", [ToolSpec("browse", "b")])
    assert make_protocol("call_tool", [ToolSpec("browse", "b")]).tools == [ToolSpec("browse", "b")]


def test_builtin_tool_names_match_the_config_choices() -> None:
    assert set(_BUILDERS) == set(BUILTIN_TOOLS)


def config(**sections) -> TrainConfig:
    return validate_train_config(from_dict(TrainConfig, sections))


def test_tools_config_accepts_mcp_servers_and_limits() -> None:
    loaded = config(
        rollout={"protocol": "call_tool", "max_tool_calls": 3, "max_calls_per_tool": {"browse": 1},
                 "max_observation_tokens": 256},
        tools={"enabled": ["browse"], "mcp": {"servers": [{"url": "http://127.0.0.1:9/mcp", "allow": ["search"]}]}},
    )
    assert loaded.tools.mcp.servers[0].allow == ["search"]
    assert loaded.rollout.max_calls_per_tool == {"browse": 1}


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"tools": {"enabled": ["serach"]}}, "'tools.enabled[0]' is 'serach'"),
        ({"rollout": {"protocol": "tulu"}}, "'rollout.protocol' must be one of search_r1, call_tool"),
        ({"tools": {"retriever": {"backend": "splade"}}}, "'tools.retriever.backend' must be one of bm25, dense"),
        ({"rollout": {"max_tool_calls": -1}}, "'rollout.max_tool_calls' must be >= 0"),
        ({"rollout": {"max_calls_per_tool": {"browse": "two"}}}, "'rollout.max_calls_per_tool.browse' must be an"),
        ({"rollout": {"max_observation_tokens": 4}}, "'rollout.max_observation_tokens' must be 0 (no cap) or >= 16"),
        ({"tools": {"mcp": {"servers": [{"url": "127.0.0.1:8001"}]}}}, "'tools.mcp.servers[0].url' must be an http"),
        ({"tools": {"mcp": {"servers": [{"uri": "x"}]}}}, "unknown config key 'tools.mcp.servers[0].uri'"),
        ({"tools": {"replay": True}}, "'tools.cache_dir' is auto: set it to the recorded run's store, e.g. "
                                      "tools.cache_dir=outputs/RUN/tool_store"),
        ({"reward": {"judge": {"replay": True, "cache_dir": ""}}}, "'reward.judge.cache_dir' is empty: set it to"),
    ],
)
def test_tools_config_errors_name_the_key(sections: dict, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        config(**sections)
    assert message in str(error.value)


def test_cache_keys_typed_calls_by_their_arguments(tmp_path) -> None:
    registry = ToolRegistry([EchoTool()], cache=ToolCache(tmp_path))
    registry.run([ToolCall("echo", "", arguments={"x": 1}), ToolCall("echo", "", arguments={"x": 2})])
    repeated = registry.run([ToolCall("echo", "", arguments={"x": 2})])
    assert repeated[0].cached
    assert (registry.cache.hits, registry.cache.misses) == (1, 2)
    assert len(list(tmp_path.rglob("*.json"))) == 2


def test_identical_paid_calls_in_flight_reach_the_api_once() -> None:
    """Samples of a group searching a web API alike at the same moment: one call goes out, every caller gets its
    result."""
    class GatedTool(EchoTool):
        paid = True

        def __init__(self) -> None:
            super().__init__("web")
            self.entered, self.release = threading.Event(), threading.Event()

        def run_batch(self, calls):
            self.entered.set()
            assert self.release.wait(10)
            return super().run_batch(calls)

    tool = GatedTool()
    registry = ToolRegistry([tool])
    first: list = []
    caller = threading.Thread(target=lambda: first.extend(registry.run([ToolCall("web", "q")])))
    caller.start()
    assert tool.entered.wait(10)
    results: list = []
    waiter = threading.Thread(target=lambda: results.extend(registry.run([ToolCall("web", "q"), ToolCall("web", "q")])))
    waiter.start()
    time.sleep(0.2)  # the second caller is waiting on the first call, not calling out
    tool.release.set()
    caller.join(10)
    waiter.join(10)
    assert tool.batches == [["q"]]
    assert [r.documents for r in results] == [first[0].documents] * 2
    assert (registry.calls_out, registry.paid_calls_out) == (1, 1)
    assert registry.stats()["paid_calls_out"] == 1
    assert registry.run([ToolCall("web", "q")])[0].documents == first[0].documents  # not in flight: called again
    assert registry.calls_out == 2
    local = EchoTool("search")  # a local tool's identical calls all go out (its server merges them)
    ToolRegistry([local]).run([ToolCall("search", "q"), ToolCall("search", "q")])
    assert local.batches == [["q", "q"]]


def test_a_replay_serves_the_recorded_tools_and_results_and_names_a_missing_call(tmp_path) -> None:
    from rlsearch.config import ToolsConfig
    from rlsearch.tools import ReplayMissError, build_registry

    recorded = ToolRegistry([EchoTool("search"), EchoTool("browse")], cache=ToolCache(tmp_path))
    recorded.cache.save_specs(recorded.specs)
    live = recorded.run([ToolCall("search", "who", {"k": "1"}), ToolCall("browse", "http://x")])

    replay = build_registry(ToolsConfig(enabled=[], cache_dir=str(tmp_path), replay=True), None, "")
    assert replay.specs == recorded.specs  # the prompt offers the same tools, in the same order
    again = replay.run([ToolCall("browse", "http://x"), ToolCall("search", "who", {"k": "1"})])
    assert [r.documents for r in again] == [live[1].documents, live[0].documents]
    assert all(r.cached for r in again) and replay.calls_out == 0
    with pytest.raises(ReplayMissError, match=r'has no result for the call \{"tool": "search", "query": "what"'):
        replay.run([ToolCall("search", "what")])
    with pytest.raises(ReplayMissError, match="tools.json does not exist"):
        build_registry(ToolsConfig(cache_dir=str(tmp_path / "elsewhere"), replay=True), None, "")


def test_a_tool_server_that_cannot_start_is_a_config_error_naming_the_key(tmp_path) -> None:
    """Training and eval start their tool servers through rollout.start_tool_servers: bad input exits 2 with this."""
    from rlsearch.config import RetrieverConfig, ToolsConfig
    from rlsearch.rollout import start_tool_servers

    missing = tmp_path / "no_corpus.jsonl"
    with pytest.raises(ConfigError, match=rf"'tools.retriever.corpus' not found: {missing}"):
        start_tool_servers(ToolsConfig(retriever=RetrieverConfig(corpus=str(missing))))
