"""Processes that do not outlive the process that made them (Linux; elsewhere these do nothing).

A child that outlives a killed parent keeps what it inherited: a tool server its port, and a child forked by a Ray
worker that worker's sockets, so that Ray never sees the worker die and every call to it waits (an actor rank killed
while Megatron's forked checkpoint writers ran held a training run for 9 minutes).

Shared-memory segments outlive a killed process too: a tensor-parallel vLLM engine's processes map segments in
/dev/shm (its broadcast queues, its CPU communicator's buffers; one of 160 MB for TP2 on CPU) and unlink them when
they shut down, not when killed. `SegmentRecord` names them under the engine's owner, and removes those of owners
that are gone.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import sys
from pathlib import Path

_forks_registered = False
SEGMENT_DIR = Path("/dev/shm")
_RECORD_PREFIX = "rlsearch-segments-"  # + host-pid-n: the segments of the processes one owner started
_records = itertools.count()


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


def _pid_exists(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def owned_file_name(prefix: str, index: int) -> str:
    """`prefix` + host-pid-index: the name of a file this process owns, which `files_of_gone_owners` finds once this
    process is gone (killed before it could remove it)."""
    return f"{prefix}{socket.gethostname()}-{os.getpid()}-{index}"


def files_of_gone_owners(directory: Path, prefix: str) -> list[Path]:
    """The files in `directory` named by `owned_file_name(prefix, ...)` on this host whose owning process is gone."""
    gone = []
    for path in directory.glob(f"{prefix}{socket.gethostname()}-*-*"):
        pid = path.name.rsplit("-", 2)[1]
        if pid.isdigit() and not _pid_exists(int(pid)):
            gone.append(path)
    return gone


def _segment_name(path: str) -> str:
    """The file name of a path in /dev/shm that still exists, else ""."""
    folder, _, name = path.rpartition("/")
    return name if folder == str(SEGMENT_DIR) and not path.endswith(" (deleted)") else ""


def _mapped_segments(pid: int) -> set[str]:
    """Names of the /dev/shm files that process `pid` maps or holds open (none when it is gone or unreadable)."""
    paths = []
    try:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            fields = line.split(maxsplit=5)
            paths.append(fields[5] if len(fields) == 6 else "")
        paths += [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
    except OSError:
        pass
    return {_segment_name(path) for path in paths} - {""}


class SegmentRecord:
    """The /dev/shm segments of the processes this process started after the record was made: recorded under this
    process, so that whoever starts next on this host removes them if this process was killed (`remove_orphans`), and
    removed by `release` after a clean stop (what the processes left behind). Linux; elsewhere it records nothing."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self._children_before = self._children()

    @staticmethod
    def _children() -> set[int]:
        import psutil

        return {child.pid for child in psutil.Process().children()}

    def record(self) -> list[str]:
        """Name the segments that the children started since construction (and their descendants) map now."""
        import psutil

        if not sys.platform.startswith("linux") or not SEGMENT_DIR.is_dir():
            return []
        started = [psutil.Process(pid) for pid in self._children() - self._children_before if _pid_exists(pid)]
        processes = set(started)
        for process in started:
            try:
                processes.update(process.children(recursive=True))
            except psutil.NoSuchProcess:
                pass
        names = sorted(set().union(*(_mapped_segments(p.pid) for p in processes)))
        names = [name for name in names if not name.startswith("rlsearch-")]  # our staged files have their own
        self.path = SEGMENT_DIR / owned_file_name(_RECORD_PREFIX, next(_records))
        self.path.write_text("\n".join(names))
        return names

    def release(self) -> None:
        """After the processes stopped: remove what they left behind, and the record."""
        if self.path is not None:
            _remove_recorded(self.path)
            self.path = None

    @staticmethod
    def remove_orphans() -> list[str]:
        """Remove the segments recorded on this host by processes that are gone; returns their names."""
        removed = []
        for record in files_of_gone_owners(SEGMENT_DIR, _RECORD_PREFIX):
            removed += _remove_recorded(record)
        return removed


def _remove_recorded(record: Path) -> list[str]:
    try:
        names = [name for name in record.read_text().splitlines() if name and "/" not in name]
    except FileNotFoundError:
        return []
    removed = []
    for name in names:
        try:
            (SEGMENT_DIR / name).unlink()
            removed.append(name)
        except FileNotFoundError:
            pass
    record.unlink(missing_ok=True)
    return removed
