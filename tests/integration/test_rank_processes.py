"""Rank processes on CPU (rlsearch.megatron.processes) are forked from one server per parent that has imported
Megatron, mbridge and transformers: ranks of later starts come from the same server, with those modules already
imported; each rank has the parent's environment and working directory as they are at its start; a rank's exception
reaches the caller; a stopped server is replaced by a new one."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from torch.multiprocessing import ProcessRaisedException

from rlsearch.megatron.processes import start_rank_processes, stop_rank_server

PRELOADED = ("torch", "megatron.core", "mbridge", "transformers", "rlsearch.megatron.model")


def _report(rank: int, out_dir: str) -> None:
    preloaded = [name for name in PRELOADED if name in sys.modules]  # before this rank imports anything
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "server": os.getppid(), "preloaded": preloaded, "variable": os.environ.get("RANK_PROCESSES_TEST"),
        "cwd": os.getcwd(),
    }))


def _fail(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 cannot go on")


def _start(out_dir: Path) -> list[dict]:
    start_rank_processes(_report, (str(out_dir),), nprocs=2)
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_ranks_fork_from_one_preloaded_server_with_the_parents_environment(tmp_path, monkeypatch):
    first = _start(tmp_path)
    assert [rank["preloaded"] for rank in first] == [list(PRELOADED)] * 2
    monkeypatch.setenv("RANK_PROCESSES_TEST", "set after the server started")
    monkeypatch.chdir(tmp_path)
    second = _start(tmp_path)
    assert {rank["server"] for rank in first} == {rank["server"] for rank in second} != {os.getpid()}
    assert [(rank["variable"], rank["cwd"]) for rank in second] == [
        ("set after the server started", str(tmp_path))] * 2
    assert [rank["variable"] for rank in first] == [None, None]

    with pytest.raises(ProcessRaisedException, match="rank 1 cannot go on"):
        start_rank_processes(_fail, (), nprocs=2)

    stop_rank_server()
    third = _start(tmp_path)
    assert len({rank["server"] for rank in third}) == 1
    assert third[0]["server"] != first[0]["server"]
    assert [rank["preloaded"] for rank in third] == [list(PRELOADED)] * 2
