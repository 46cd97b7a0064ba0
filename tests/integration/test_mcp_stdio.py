"""stdio MCP servers started by rlsearch: a third-party one (mcp-server-time), our own (`rlsearch serve-mcp
--transport stdio`) and a test one; typed arguments, JSON <call_tool> bodies, a killed process, no process left."""

import json
import os
import signal
import sys
import textwrap
import threading

import psutil
import pytest

from rlsearch.config import MCPConfig, MCPServerConfig, RetrieverConfig, ToolsConfig
from rlsearch.tools import CallToolProtocol, ErrorKind, ToolCall, ToolRegistry, ToolSetupError, build_registry
from rlsearch.tools.clients.mcp import MCPServerSpec, MCPToolset

TIME_SERVER = [sys.executable, "-m", "mcp_server_time", "--local-timezone", "UTC"]
# the one the kill test starts, told apart from the module's by its command line
KILLED_TIME_SERVER = [sys.executable, "-m", "mcp_server_time", "--local-timezone", "Etc/UTC"]
NOON_UTC_TO_TOKYO = {"source_timezone": "UTC", "time": "12:00", "target_timezone": "Asia/Tokyo"}
STUCK_S = 60.0  # a tool call that would outlast its 20 s timeout

# a stdio server of the test's own: a tool that takes as long as asked, and one that reads its environment
TEST_SERVER = textwrap.dedent("""
    import asyncio
    import os

    from mcp.server.mcpserver import MCPServer

    server = MCPServer("test")

    @server.tool(name="sleepy", description="sleeps")
    async def sleepy(seconds: float) -> str:
        await asyncio.sleep(seconds)
        return f"slept {seconds}"

    @server.tool(name="getenv", description="an environment variable of the server")
    def getenv(name: str) -> str:
        return os.environ.get(name, "<unset>")

    server.run("stdio")
""")


def registry_of(command: list[str], max_retries: int = 0, **server: object) -> ToolRegistry:
    mcp = MCPConfig(servers=[MCPServerConfig(command=command, **server)], timeout_s=20, max_retries=max_retries,
                    backoff_s=0.05)
    return build_registry(ToolsConfig(enabled=[], mcp=mcp), RetrieverConfig(), "")


def server_pids(marker: str) -> list[int]:
    """Live processes under this one whose command line contains ``marker``."""
    pids = []
    for process in psutil.Process().children(recursive=True):
        try:
            if process.status() != psutil.STATUS_ZOMBIE and marker in " ".join(process.cmdline()):
                pids.append(process.pid)
        except psutil.Error:  # it ended while being looked at
            continue
    return pids


def target_time(result) -> tuple[str, str]:
    """The converted time and the offset of a convert_time result (its text is the JSON result)."""
    assert result.ok, result.error
    converted = json.loads(result.documents[0].text)
    return converted["target"]["datetime"][11:], converted["time_difference"]


@pytest.fixture(scope="module")
def time_registry():
    registry = registry_of(TIME_SERVER)
    yield registry
    registry.close()


def test_third_party_server_tools_come_with_their_json_schemas(time_registry) -> None:
    assert time_registry.names == ["get_current_time", "convert_time"]
    specs = {spec.name: spec.parameters for spec in time_registry.specs}
    assert specs["get_current_time"]["required"] == ["timezone"]
    assert specs["convert_time"]["required"] == ["source_timezone", "time", "target_timezone"]
    assert {key: value["type"] for key, value in specs["convert_time"]["properties"].items()} == {
        "source_timezone": "string", "time": "string", "target_timezone": "string"
    }


def test_typed_arguments_and_the_query_form_reach_the_third_party_server(time_registry) -> None:
    typed, query_form = time_registry.run([
        ToolCall("convert_time", "", arguments=NOON_UTC_TO_TOKYO), ToolCall("get_current_time", "Asia/Tokyo"),
    ])
    assert target_time(typed) == ("21:00:00+09:00", "+9.0h")
    assert query_form.ok and json.loads(query_form.documents[0].text)["timezone"] == "Asia/Tokyo"
    (bad_time,) = time_registry.run([ToolCall("convert_time", "", arguments={**NOON_UTC_TO_TOKYO, "time": "25:99"})])
    assert (bad_time.error_kind, bad_time.error) == (
        ErrorKind.TOOL_ERROR, "Error executing tool convert_time: Invalid time format. Expected HH:MM [24-hour format]"
    )


def test_json_call_tool_body_runs_through_protocol_and_registry(time_registry) -> None:
    protocol = CallToolProtocol(time_registry.specs)
    body = json.dumps(NOON_UTC_TO_TOKYO)
    turn = protocol.parse_turn(f'<think>convert it</think>\n<call_tool name="convert_time">{body}</call_tool>')
    assert turn.call.arguments == NOON_UTC_TO_TOKYO
    # a tag attribute fills in what the JSON leaves out
    partial = protocol.parse_turn(
        '<call_tool name="convert_time" target_timezone="Asia/Kolkata">{"source_timezone": "UTC", "time": "12:00"}'
        "</call_tool>"
    )
    tokyo, kolkata = time_registry.run([turn.call, partial.call])
    assert target_time(tokyo) == ("21:00:00+09:00", "+9.0h")
    assert target_time(kolkata) == ("17:30:00+05:30", "+5.5h")


def test_killed_server_gives_an_error_then_is_restarted_and_close_leaves_no_process() -> None:
    registry = registry_of(KILLED_TIME_SERVER)
    try:
        assert target_time(registry.run([ToolCall("convert_time", "", arguments=NOON_UTC_TO_TOKYO)])[0])[1] == "+9.0h"
        (first_pid,) = server_pids("Etc/UTC")
        os.kill(first_pid, signal.SIGKILL)
        (down,) = registry.run([ToolCall("convert_time", "", arguments=NOON_UTC_TO_TOKYO)])
        # ended by the closed connection, not by the call's 20 s timeout (ErrorKind.TIMEOUT)
        assert down.error_kind is ErrorKind.TOOL_ERROR
        assert "unreachable after 1 attempts: MCPError: Connection closed" in down.error
        assert not psutil.pid_exists(first_pid)  # reaped when the broken session was dropped
        (again,) = registry.run([ToolCall("convert_time", "", arguments=NOON_UTC_TO_TOKYO)])
        assert target_time(again) == ("21:00:00+09:00", "+9.0h")
        (second_pid,) = server_pids("Etc/UTC")
        assert second_pid != first_pid
        assert registry.stats() == {"requests": 3, "retries": 0, "failures": 1, "restarts": 1, "calls_out": 3,
                                    "paid_calls_out": 0}
    finally:
        registry.close()
    assert server_pids("Etc/UTC") == []


@pytest.fixture(scope="module")
def test_server(tmp_path_factory) -> list[str]:
    path = tmp_path_factory.mktemp("stdio-server") / "test_server.py"
    path.write_text(TEST_SERVER)
    return [sys.executable, str(path)]


def test_process_death_fails_the_calls_in_flight_or_retries_them_on_a_restarted_server(test_server) -> None:
    def kill_soon() -> None:
        (pid,) = server_pids("test_server.py")
        threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()

    def sleep_calls(seconds: float) -> list[ToolCall]:
        return [ToolCall("sleepy", "", arguments={"seconds": seconds}) for _ in range(2)]

    no_retry = MCPToolset([MCPServerSpec(command=tuple(test_server), allow=("sleepy",))], timeout_s=20, max_retries=0)
    try:
        kill_soon()
        # calls that would sleep past their 20 s timeout end with the process: not ErrorKind.TIMEOUT, and not retried
        failed = no_retry.tools[0].run_batch(sleep_calls(STUCK_S))
        assert [r.error_kind for r in failed] == [ErrorKind.TOOL_ERROR] * 2
        assert all("Connection closed" in r.error for r in failed)
        assert no_retry.tools[0].stats() == {"requests": 2, "retries": 0, "failures": 2, "restarts": 0}
    finally:
        no_retry.close()
    retrying = MCPToolset([MCPServerSpec(command=tuple(test_server), allow=("sleepy",))], timeout_s=20,
                          max_retries=1, backoff_s=0.05)
    try:
        kill_soon()
        (sleepy,) = retrying.tools
        assert [r.documents[0].text for r in sleepy.run_batch(sleep_calls(1.5))] == ["slept 1.5"] * 2
        assert sleepy.stats() == {"requests": 2, "retries": 2, "failures": 0, "restarts": 1}  # one restart for both
    finally:
        retrying.close()
    assert server_pids("test_server.py") == []


def test_stdio_server_inherits_the_environment_plus_its_env(test_server, monkeypatch) -> None:
    monkeypatch.setenv("RLSEARCH_TEST_INHERITED", "from rlsearch")
    registry = registry_of(test_server, allow=["getenv"], env={"RLSEARCH_TEST_EXTRA": "42"})
    try:
        inherited, extra = registry.run([ToolCall("getenv", "RLSEARCH_TEST_INHERITED"),
                                         ToolCall("getenv", "RLSEARCH_TEST_EXTRA")])
        assert (inherited.documents[0].text, extra.documents[0].text) == ("from rlsearch", "42")
    finally:
        registry.close()


def test_missing_command_is_a_setup_error_naming_it_and_the_config_key(monkeypatch) -> None:
    import mcp.client.stdio

    started: list[str] = []  # the command of each server process the client tried to start
    start_process = mcp.client.stdio.stdio_client

    def counted_start(server, *args, **kwargs):
        started.append(server.command)
        return start_process(server, *args, **kwargs)

    monkeypatch.setattr(mcp.client.stdio, "stdio_client", counted_start)
    with pytest.raises(ToolSetupError, match=(
        r"cannot list the tools of MCP server rlsearch-no-such-server --flag: command 'rlsearch-no-such-server' not "
        r"found; install it, or give its full path in tools\.mcp\.servers\[0\]\.command"
    )):
        registry_of(["rlsearch-no-such-server", "--flag"], max_retries=3)
    assert started == ["rlsearch-no-such-server"]  # not retried: it would fail the same way


def test_server_that_exits_at_start_up_shows_its_stderr() -> None:
    command = [sys.executable, "-c", "import sys; print('starting', file=sys.stderr); sys.exit('no config at /x.toml')"]
    with pytest.raises(ToolSetupError) as raised:
        registry_of(command)
    assert str(raised.value).endswith(
        ": the server process did not start (MCPError: Connection closed; check tools.mcp.servers[0].command); "
        "its stderr ends: starting | no config at /x.toml"
    )


def test_own_mcp_server_over_stdio_searches_the_toy_corpus(toy_data, tmp_path) -> None:
    command = [sys.executable, "-m", "rlsearch", "serve-mcp", "--transport", "stdio",
               "--corpus", str(toy_data.corpus), "--cache-dir", str(tmp_path)]
    registry = registry_of(command)
    try:
        assert registry.names == ["search", "browse"]
        rows = [json.loads(line) for line in toy_data.train.open()][:6]
        results = registry.run([ToolCall("search", row["question"], {"topk": "3"}) for row in rows])
        assert all(result.ok and len(result.documents) == 3 for result in results)
        found = sum(row["metadata"]["passage_id"] in [d.id for d in r.documents] for row, r in zip(rows, results))
        assert found >= 4
        (page,) = registry.run([ToolCall("browse", "", arguments={"url": results[0].documents[0].url})])
        assert page.documents[0].kind == "webpage" and page.documents[0].text == results[0].documents[0].text
    finally:
        registry.close()
    assert server_pids("serve-mcp") == []
