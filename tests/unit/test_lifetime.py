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
