"""Rollout engines killed with SIGKILL at points of a training run (its first sync, a line it prints), the run's
senders held stopped meanwhile where the point is inside a sync."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from rlsearch.weights.shm import SENDER_FILE_PREFIX, STAGING_DIR
from tests.constants import REPO_ROOT
from tests.faults.processes import engine_processes, logged_pids


def sender_files(run_dir: Path) -> set[Path]:
    """The bucket files of the weight senders of the run in `run_dir` (its actor ranks; shm transport): the first
    appears when a sync starts. Those of another test's senders (the other lane's) are not the run's."""
    prefix = f"{SENDER_FILE_PREFIX}{socket.gethostname()}-"
    ranks = {str(pid) for pid in logged_pids(run_dir, "actor-rank*")}
    return {path for path in Path(STAGING_DIR).glob(f"{prefix}*")
            if path.name.removeprefix(prefix).split("-", 1)[0] in ranks}


KillPoint = Callable[[], "list[int] | None"]


def first_sync_started(run_dir: Path) -> KillPoint:
    """A kill point: the first sync of the run in `run_dir` has started, its sender writing its first bucket file.
    The sender is held stopped while the engine is killed: a tiny model's sync can end before the kill lands."""
    before = sender_files(run_dir)
    prefix = f"{SENDER_FILE_PREFIX}{socket.gethostname()}-"

    def senders() -> list[int] | None:
        started = sender_files(run_dir) - before
        return sorted({int(path.name.removeprefix(prefix).split("-", 1)[0]) for path in started}) or None

    return senders


def printed(log_path: Path, text: str) -> KillPoint:
    """A kill point: the run printed `text`."""
    return lambda: [] if text in log_path.read_text() else None


def run_killing_engines(command: list[str], log_path: Path, env: dict, kills: list[KillPoint],
                        engines: Callable[[], dict[str, psutil.Process]] = engine_processes,
                        ) -> tuple[int, str, list[str]]:
    """Run `command` (a training run, with `env` on top of this process's environment), output to `log_path`; at
    each of `kills` in turn (None until it is reached, then the pids to hold stopped until the kill is done), kill one
    of its rollout engines with SIGKILL: the first of `engines()` (by default those on the test session's Ray, by Ray
    name) not killed before. Returns the run's exit status, its output and the killed engines' keys."""
    with log_path.open("w") as log:
        run = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
    killed: list[str] = []
    try:
        for kill_point in kills:
            deadline = time.monotonic() + 600
            while (held := kill_point()) is None:
                assert run.poll() is None and time.monotonic() < deadline, (
                    "the run ended, or reached no kill point in 600 s (a hang guard): " + log_path.read_text()[-3000:])
                time.sleep(0.01)
            for pid in held:
                os.kill(pid, signal.SIGSTOP)
            try:
                key, victim = next((key, process) for key, process in engines().items() if key not in killed)
                os.kill(victim.pid, signal.SIGKILL)
                victim.wait(timeout=60)
            finally:
                for pid in held:
                    os.kill(pid, signal.SIGCONT)
            killed.append(key)
        returncode = run.wait(timeout=900)
    finally:
        if run.poll() is None:
            run.kill()
    return returncode, log_path.read_text(), killed
