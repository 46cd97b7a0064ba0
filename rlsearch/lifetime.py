"""Processes that do not outlive the process that made them (Linux; elsewhere these do nothing).

A child that outlives a killed parent keeps what it inherited: a tool server its port, and a child forked by a Ray
worker that worker's sockets, so that Ray never sees the worker die and every call to it waits (an actor rank killed
while Megatron's forked checkpoint writers ran held a training run for 9 minutes).
"""

from __future__ import annotations

import os
import signal
import sys

_forks_registered = False


def die_with_parent(signal_number: int = signal.SIGTERM) -> None:
    """In a child: receive `signal_number` when the thread that started it ends (its process killed, even by
    SIGKILL). The signal follows the *thread*: start children from a thread that lives as long as they should."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal_number)


def forked_children_die_with_this_process() -> None:
    """From now on every child this process forks without exec (`os.fork`: multiprocessing's fork context, e.g.
    Megatron's checkpoint writers) is killed when the forking thread's process dies. Idempotent."""
    global _forks_registered
    if _forks_registered:
        return
    parent = os.getpid()

    def in_child() -> None:
        die_with_parent(signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the line above
            os.kill(os.getpid(), signal.SIGKILL)

    os.register_at_fork(after_in_child=in_child)
    _forks_registered = True
