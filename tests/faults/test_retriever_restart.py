"""The retrieval server killed (SIGKILL) as a rollout starts and restarted on its port 2 s later: the rollout
finishes, the searches that met the dead server end as error observations and are counted, and the next rollout's
searches are answered again."""

from __future__ import annotations

import time

import ray

from tests.integration.rollout_checks import prompt_items

RESTART_AFTER_S = 2.0


def test_a_rollout_survives_a_retriever_restart_and_the_next_one_uses_it(rollout_worker, retriever, toy_data):
    port = retriever.port
    ray.get(rollout_worker.generate.remote(prompt_items(toy_data, prompts=1, samples=1), 10))  # a warm engine
    before = ray.get(rollout_worker.tool_stats.remote())
    pending = rollout_worker.generate.remote(prompt_items(toy_data), 11)
    retriever.kill()  # the first turn is still generating: its searches meet a dead server
    time.sleep(RESTART_AFTER_S)
    retriever.start()  # from this thread: a server dies with the thread that started it (PR_SET_PDEATHSIG)
    assert retriever.port == port
    during = ray.get(pending, timeout=300)

    failed = [turn for t in during for turn in t.turns if turn.tool_calls and not turn.tool_calls[0].ok]
    assert failed, "no search met the dead server"
    assert all(turn.error_kind in ("tool_error", "timeout") for turn in failed)
    assert all(turn.observation.startswith("\n\n<information>") and "search failed" in turn.observation
               for turn in failed)
    assert all(t.finish_reason for t in during)
    after_gap = ray.get(rollout_worker.tool_stats.remote())
    assert after_gap["failures"] - before["failures"] == len(failed)
    assert after_gap["retries"] > before["retries"]  # each failed request was retried with backoff first

    time.sleep(0.5)
    healthy = ray.get(rollout_worker.generate.remote(prompt_items(toy_data), 12), timeout=300)
    calls = [call for t in healthy for call in t.dispatched_calls]
    assert calls and all(call.ok for call in calls)
    assert ray.get(rollout_worker.tool_stats.remote())["failures"] == after_gap["failures"]


def test_a_training_run_starts_its_killed_tool_servers_again_on_their_ports(toy_data, tmp_path):
    """`ToolServers.revive` (the trainer calls it before each rollout): the retriever and the local MCP server,
    killed with SIGKILL, are started again on the same ports and answer; servers that run are left alone."""
    import os
    import signal

    import httpx

    from rlsearch.config import MCPConfig, RetrieverConfig, ToolsConfig
    from rlsearch.tools import ToolServers

    config = ToolsConfig(enabled=["search"], mcp=MCPConfig(start_local=True, timeout_s=10),
                         retriever=RetrieverConfig(corpus=str(toy_data.corpus), index_cache_dir=str(tmp_path)))
    with ToolServers(config) as servers:
        ports = (servers.retriever.port, servers.mcp.port)
        assert servers.revive() == []
        for pid in (servers.retriever.pid, servers.mcp.pid):  # only these: the session's retriever stays up
            os.kill(pid, signal.SIGKILL)  # not reaped here: the server's owner sees how it ended
        deadline = time.monotonic() + 10
        while None in (servers.retriever.exit_status(), servers.mcp.exit_status()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert servers.revive() == [
            f"the local retriever had ended (killed by signal 9); started again on port {ports[0]}",
            f"the local mcp server had ended (killed by signal 9); started again on port {ports[1]}",
        ]
        assert (servers.retriever.port, servers.mcp.port) == ports
        query = "an inventor who built a machine"  # the toy corpus's wording
        answer = httpx.post(f"{servers.retriever.url}/retrieve", json={"queries": [query], "topk": 1}, timeout=30)
        assert answer.status_code == 200 and len(answer.json()["result"][0]) == 1
        assert servers.revive() == []
