"""The ranks of a torch.distributed group as processes spawned by a test (no Ray, no engine)."""

from __future__ import annotations

import time

import pytest


def run_spawned_ranks(rank_main, nprocs: int, out_dir: str, time_limit_s: float) -> None:
    """`rank_main(rank, rendezvous_address, out_dir)` in `nprocs` spawned processes, the group's store opened here;
    the test fails when a rank fails, or, killing them all, when they have not finished within `time_limit_s`."""
    import torch.multiprocessing as mp

    from rlsearch.rendezvous import Rendezvous

    rendezvous = Rendezvous("127.0.0.1", time_limit_s)
    try:
        ranks = mp.start_processes(rank_main, args=(rendezvous.address, out_dir), nprocs=nprocs, join=False,
                                   start_method="spawn")
        deadline = time.monotonic() + time_limit_s
        while not ranks.join(timeout=1):  # raises when a rank fails
            if time.monotonic() > deadline:
                for process in ranks.processes:
                    process.kill()
                pytest.fail(f"the ranks did not finish in {time_limit_s:g} s")
    finally:
        rendezvous.close()
