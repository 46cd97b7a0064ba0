"""Children that do not outlive their parent: a forked child (as Megatron's checkpoint writers are) of a process
killed with SIGKILL is killed too, once the parent asked for it; without that it lives on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

# a parent that forks a child which sleeps, prints the child's pid, then waits to be killed
_PARENT = """
import os, sys, time
from rlsearch.lifetime import forked_children_die_with_this_process
if sys.argv[1] == "registered":
    forked_children_die_with_this_process()
    forked_children_die_with_this_process()  # idempotent: one hook
pid = os.fork()
if pid == 0:
    time.sleep(60)
    os._exit(0)
print(pid, flush=True)
time.sleep(60)
"""


def _orphan_after_killing_its_parent(mode: str, wait_s: float) -> psutil.Process | None:
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, mode], stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(parent.stdout.readline()))
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(10)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not child.is_running() or child.status() == psutil.STATUS_ZOMBIE:
            return None
        time.sleep(0.05)
    return child


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_forked_child_dies_with_its_killed_parent_only_when_the_parent_asked() -> None:
    assert _orphan_after_killing_its_parent("registered", wait_s=10) is None
    orphan = _orphan_after_killing_its_parent("plain", wait_s=2)
    assert orphan is not None  # the default: a forked child outlives its parent (what held Ray's sockets)
    orphan.kill()


# an owner (as an engine's host) that starts a child mapping a shared-memory segment which nothing unlinks when the
# child is killed (as vLLM's processes map theirs), records it, prints the child's pid and the names, then waits
_OWNER = """
import subprocess, sys, time
from rlsearch.lifetime import SegmentRecord
record = SegmentRecord()
child = subprocess.Popen([sys.executable, "-c", '''
import time
from multiprocessing import resource_tracker, shared_memory
segment = shared_memory.SharedMemory(create=True, size=1 << 20)
resource_tracker.unregister(segment._name, "shared_memory")
print(segment.name, flush=True)
time.sleep(60)
'''], stdout=subprocess.PIPE, text=True)
child.stdout.readline()
print(child.pid, ",".join(record.record()), flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_segments_of_a_killed_owners_children_are_removed_and_those_of_a_live_one_kept() -> None:
    from multiprocessing import shared_memory

    from rlsearch.lifetime import SEGMENT_DIR, SegmentRecord

    unrelated = shared_memory.SharedMemory(create=True, size=4096)  # this process's own: never recorded
    owners, children, names = [], [], []
    try:
        for _ in range(2):
            owners.append(subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True))
            pid, recorded = owners[-1].stdout.readline().split()
            children.append(psutil.Process(int(pid)))
            names.append(recorded.split(","))
        assert all(len(recorded) == 1 and (SEGMENT_DIR / recorded[0]).exists() for recorded in names)
        assert unrelated.name not in names[0] + names[1]
        for process in (children[0], owners[0]):
            os.kill(process.pid, signal.SIGKILL)
        owners[0].wait(10)
        children[0].wait(10)
        assert (SEGMENT_DIR / names[0][0]).exists()  # a killed process leaves its segment behind
        removed = SegmentRecord.remove_orphans()  # with those of any other gone owner on this host (earlier tests')
        assert names[0][0] in removed and names[1][0] not in removed
        assert not (SEGMENT_DIR / names[0][0]).exists() and (SEGMENT_DIR / names[1][0]).exists()
        assert (SEGMENT_DIR / unrelated.name.lstrip("/")).exists()
        for process in (children[1], owners[1]):
            os.kill(process.pid, signal.SIGKILL)
        owners[1].wait(10)
        children[1].wait(10)
        assert names[1][0] in SegmentRecord.remove_orphans()  # the other owner's, once it is gone
    finally:
        for process in (*children, *owners):
            if psutil.pid_exists(process.pid):
                process.kill()
        for owner in owners:
            owner.wait(10)
        SegmentRecord.remove_orphans()
        unrelated.close()
        unrelated.unlink()
