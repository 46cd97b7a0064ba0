"""Megatron rank processes on this host without Ray: the converter's ranks, and any script's or test's.

On CPU they are forked from one server process per parent (multiprocessing's forkserver) that has imported torch,
Megatron, mbridge and transformers once (rank_imports.py): a spawned rank spends 6-8 s of CPU on those imports, a
forked one ~0.05 s after the server's first start. Each forked rank takes the parent's environment and working
directory as they are when it starts, as a spawned one would (the server's are those of its own start).

With GPUs the ranks are spawned: each sets its visible GPU before CUDA starts, which a process forked from one whose
imports may have queried the CUDA driver could not rely on."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
from collections.abc import Callable

RANK_IMPORTS = "rlsearch.megatron.rank_imports"


def rank_start_method(on_gpus: bool) -> str:
    """"spawn" for GPU ranks, else "forkserver" with the rank imports preloaded (set once per process)."""
    if on_gpus:
        return "spawn"
    multiprocessing.set_forkserver_preload([RANK_IMPORTS])
    return "forkserver"


def start_rank_processes(entry: Callable, args: tuple, nprocs: int, on_gpus: bool = False, join: bool = True):
    """`entry(rank, *args)` in `nprocs` processes (torch.multiprocessing.start_processes: a rank's exception is
    raised here when joined); with ``join=False`` the ProcessContext to join."""
    import torch.multiprocessing as mp

    method = rank_start_method(on_gpus)
    if method == "forkserver":
        entry, args = _in_parent_environment, (dict(os.environ), os.getcwd(), entry, args)
    return mp.start_processes(entry, args=args, nprocs=nprocs, join=join, start_method=method)


def stop_rank_server() -> None:
    """Stop this process's fork server (it holds ~0.6 GB of imported modules); the next CPU ranks start a new one."""
    multiprocessing.forkserver._forkserver._stop()


def _in_parent_environment(rank: int, environ: dict[str, str], cwd: str, entry: Callable, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    entry(rank, *args)
