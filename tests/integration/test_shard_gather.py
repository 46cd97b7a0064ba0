"""`ShardGather` (rlsearch/weights/gather.py) on three gloo rank processes of one host: through shared memory, every
rank's tensor reaches rank 0 bit for bit, call after call, while rank 0 lags behind the others; kept shards stay
valid; ranks that do not see each other's files (each its own staging directory, as containers with their own
/dev/shm, where files of the same names are not the same files) fall back to the process group's gather with the
same results, as do ranks of which one has no room for its files; `close` removes the files."""

from __future__ import annotations

import errno
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from tests.integration.rank_processes import run_rank_processes

RANKS = 3
CALLS = 7  # more than the files a rank keeps: every file is rewritten
TIME_LIMIT_S = 120.0
DTYPES = (torch.bfloat16, torch.float32, torch.int64)


def _tensor(rank: int, call: int) -> torch.Tensor:
    """Rank `rank`'s tensor of call `call`: shapes and dtypes change from call to call, values from rank to rank."""
    generator = torch.Generator().manual_seed(1000 * call + rank)
    shape = (3 + call, 5 + 2 * call)
    dtype = DTYPES[call % len(DTYPES)]
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(-2**40, 2**40, shape, generator=generator, dtype=dtype)


def _largest() -> int:
    return max(t.numel() * t.element_size() for t in (_tensor(0, call) for call in range(CALLS)))


def _gather_all(gather, rank: int, lag_s: float) -> tuple[list[bool], list[bool]]:
    """Every call's gather; on rank 0, per call, whether the shards equal every rank's tensor bit for bit when read
    after `lag_s` (the others run ahead meanwhile), and whether the kept shards still do after the last call."""
    exact_now, kept = [], []
    for call in range(CALLS):
        keep = call % 2 == 0
        shards = gather.gather(_tensor(rank, call), keep=keep)
        if rank != 0:
            assert shards is None
            continue
        time.sleep(lag_s)
        expected = [_tensor(r, call) for r in range(RANKS)]
        exact_now.append(all(torch.equal(s.view(torch.uint8), e.view(torch.uint8)) for s, e in zip(shards, expected)))
        if keep:
            kept.append((shards, expected))
    return exact_now, [all(torch.equal(s.view(torch.uint8), e.view(torch.uint8)) for s, e in zip(*pair))
                       for pair in kept]


def _rank_main(rank: int, rendezvous: str, out_dir: str) -> None:
    import torch.distributed as dist

    from rlsearch.lifetime import owned_file_name
    from rlsearch.rendezvous import join_store
    from rlsearch.weights import gather as gather_module

    dist.init_process_group("gloo", store=join_store(rendezvous, TIME_LIMIT_S), rank=rank, world_size=RANKS,
                            timeout=timedelta(seconds=TIME_LIMIT_S))
    results = {}
    shared = gather_module.ShardGather(dist.group.WORLD, _largest())
    results["shared"] = _gather_all(shared, rank, lag_s=0.05)
    results["shared_memory"] = shared.shared_memory
    results["files_while_open"] = [path for path, _ in shared._own_files]
    shared.close()
    results["files_after_close"] = [path for path in results["files_while_open"] if os.path.exists(path)]

    # each rank its own /dev/shm, as containers have: a relative staging directory, resolved in each rank's own
    # working directory; where rank 0 looks for a rank's files it finds others of the same names and sizes (another
    # container's), so only the token tells them apart
    own_dir = Path(out_dir) / f"rank-{rank}" / "staging"
    own_dir.mkdir(parents=True, exist_ok=True)
    os.chdir(own_dir.parent)
    gather_module.STAGING_DIR = "staging"
    if rank != 0:
        rank_0_dir = Path(out_dir) / "rank-0" / "staging"
        rank_0_dir.mkdir(parents=True, exist_ok=True)
        for index in range(gather_module.FILES_PER_RANK):
            name = owned_file_name(gather_module.SHARD_FILE_PREFIX, index)
            (rank_0_dir / name).write_bytes(bytes(_largest()))
    separate = gather_module.ShardGather(dist.new_group(list(range(RANKS))), _largest())
    results["separate"] = _gather_all(separate, rank, lag_s=0.0)
    results["separate_shared_memory"] = separate.shared_memory
    results["separate_files_left"] = sorted(p.name for p in own_dir.iterdir()) if rank else []
    separate.close()

    gather_module.STAGING_DIR = str(own_dir)
    if rank == RANKS - 1:  # no room in this rank's /dev/shm: it cannot reserve its files

        def full(*_):
            raise OSError(errno.ENOSPC, "No space left on device")

        os.posix_fallocate = full
    crowded = gather_module.ShardGather(dist.new_group(list(range(RANKS))), _largest())
    results["crowded"] = _gather_all(crowded, rank, lag_s=0.0)
    results["crowded_shared_memory"] = crowded.shared_memory
    results["crowded_files_left"] = sorted(p.name for p in own_dir.iterdir()) if rank else []
    crowded.close()
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def gathered(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("shard_gather")
    run_rank_processes(_rank_main, RANKS, str(out_dir), TIME_LIMIT_S)
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(RANKS)]


def test_shared_memory_gather_is_bit_exact_while_rank_0_lags(gathered):
    assert all(result["shared_memory"] for result in gathered)
    exact_now, kept = gathered[0]["shared"]
    assert exact_now == [True] * CALLS
    assert kept == [True] * len(range(0, CALLS, 2))


def test_each_other_rank_keeps_two_files_and_close_removes_them(gathered):
    assert gathered[0]["files_while_open"] == []  # rank 0 only maps the others' files
    for result in gathered[1:]:
        assert len(result["files_while_open"]) == 2
        assert result["files_after_close"] == []


@pytest.mark.parametrize("case", ["separate", "crowded"], ids=["files_not_visible_to_rank_0", "a_rank_without_room"])
def test_the_group_falls_back_to_the_process_group_with_the_same_results(gathered, case):
    """"separate": the ranks cannot see each other's files; "crowded": one rank has no room for its files."""
    assert [result[f"{case}_shared_memory"] for result in gathered] == [False] * RANKS
    exact_now, kept = gathered[0][case]
    assert exact_now == [True] * CALLS
    assert kept == [True] * len(range(0, CALLS, 2))
    # the files reserved to offer the shared way (by every rank that had room) went when the group fell back
    assert all(result[f"{case}_files_left"] == [] for result in gathered)
