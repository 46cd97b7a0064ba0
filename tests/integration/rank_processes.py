"""The ranks of a torch.distributed group as processes a test starts (no Ray, no engine): forked from the lane's
rank server (rlsearch.megatron.processes), which has the imports of a Megatron rank done."""

from __future__ import annotations

import time

import pytest

# a hang guard, not a speed limit: the slowest of these groups took 619 s on the slowest CPU seen (a 2-core AMD EPYC
# with AVX2, test_optimizer_offload's with the real vocabulary), under a minute on the faster ones
HANG_GUARD_S = 900.0


def run_rank_processes(rank_main, nprocs: int, out_dir: str, time_limit_s: float = HANG_GUARD_S) -> None:
    """`rank_main(rank, rendezvous_address, out_dir)` in `nprocs` processes, the group's store opened here;
    the test fails when a rank fails, or, killing them all, when they have not finished within `time_limit_s`."""
    from rlsearch.megatron.processes import start_rank_processes
    from rlsearch.rendezvous import Rendezvous

    rendezvous = Rendezvous("127.0.0.1", time_limit_s)
    try:
        ranks = start_rank_processes(rank_main, (rendezvous.address, out_dir), nprocs, join=False)
        deadline = time.monotonic() + time_limit_s
        while not ranks.join(timeout=1):  # raises when a rank fails
            if time.monotonic() > deadline:
                for process in ranks.processes:
                    process.kill()
                pytest.fail(f"the ranks did not finish in {time_limit_s:g} s, the hang guard (sized for the slowest "
                            "CPU seen, tests/integration/rank_processes.py): they were killed")
    finally:
        rendezvous.close()
