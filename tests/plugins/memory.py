"""The memory lock: the modules and tests marked memory_heavy never run beside each other in the two lanes."""

from __future__ import annotations

import fcntl
import hashlib
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest

from rlsearch.megatron.processes import stop_rank_server
from tests.constants import REPO_ROOT
from tests.plugins.lanes import DRIVER_TESTS
from tests.plugins.shared_engines import RANK_POOL


class MemoryLock:
    """An exclusive lock (flock) the two lanes share: the modules and tests that hold several GiB at once (2 x TP2
    engines, MoE engines beside expert-parallel ranks) take it, so that two of them never run side by side within
    CI's 24 GiB. Within one lane it is free: a lane runs one test at a time."""

    def __init__(self) -> None:
        checkout = hashlib.sha1(str(REPO_ROOT).encode()).hexdigest()[:8]  # lanes of one suite, not another checkout's
        self.path = Path(tempfile.gettempdir()) / f"rlsearch-tests-{checkout}.lock"
        self.waits = self.path.with_suffix(".waits")  # "seconds holder" per wait of a second or more

    @contextmanager
    def held(self, holder: str):
        with self.path.open("a") as handle:
            asked = time.monotonic()
            fcntl.flock(handle, fcntl.LOCK_EX)
            waited = time.monotonic() - asked
            if waited >= 1.0:
                with self.waits.open("a") as record:
                    record.write(f"{waited:.0f} {holder}\n")
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def summary(self) -> str | None:
        """The lanes' waits for the lock in this run, in a line (None without any)."""
        if not self.waits.exists():
            return None
        waits = [(float(seconds), holder) for seconds, holder in
                 (line.split(" ", 1) for line in self.waits.read_text().splitlines())]
        longest = max(waits)
        return (f"memory lock: the lanes waited {sum(w for w, _ in waits):.0f} s for it, {len(waits)} times; the "
                f"longest {longest[0]:.0f} s, before {longest[1]}")


MEMORY_LOCK = MemoryLock()


@pytest.fixture(scope="module", autouse=True)
def _module_memory(request):
    """A module marked memory_heavy (its pytestmark) holds the lanes' memory lock from its first test to its last.
    The lane's idle pooled ranks are stopped before it and before any module that does not use them: they wait only
    among the groups of one module, or of modules that use the pool one after another. The lane's rank server
    (rlsearch.megatron.processes: ~0.6 GB) is stopped before it too, and after each module of the drivers, whose lane
    runs beside the memory-heavy modules without the lock (test_train_resume's conversion starts one)."""
    heavy = _module_memory_heavy(request.module)
    if heavy:
        stop_rank_server()
    if heavy or not any("rank_pool" in item.fixturenames for item in request.session.items
                        if item.module is request.module):
        RANK_POOL.drain()
    with MEMORY_LOCK.held(request.module.__name__) if heavy else nullcontext():
        yield
    if request.node.nodeid.startswith(DRIVER_TESTS):
        stop_rank_server()


@pytest.fixture(autouse=True)
def _memory_heavy_test(request):
    """A test marked memory_heavy holds the lanes' memory lock while it runs."""
    marked = request.node.get_closest_marker("memory_heavy") is not None and not _module_memory_heavy(request.module)
    if marked:
        RANK_POOL.drain()
        stop_rank_server()
    with MEMORY_LOCK.held(request.node.nodeid) if marked else nullcontext():
        yield


def _module_memory_heavy(module) -> bool:
    marks = getattr(module, "pytestmark", [])
    return any(mark.name == "memory_heavy" for mark in (marks if isinstance(marks, list) else [marks]))



def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the run itself, not one of its lanes
        MEMORY_LOCK.waits.unlink(missing_ok=True)


def pytest_terminal_summary(terminalreporter):
    line = MEMORY_LOCK.summary()
    if line:
        terminalreporter.write_line(line)
