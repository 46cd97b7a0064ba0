"""The broadcast transport's process groups: one actor stage's sender (rank 0) and every worker of every engine.

These processes already belong to other default groups (Megatron's, each vLLM engine's TP group), so a group is
made outside the default world, from its own TCP rendezvous. Every member must call `new_weight_group` at about
the same time: the rendezvous waits (at most ``timeout_s``) for all of them.
"""

from __future__ import annotations

from datetime import timedelta


def rank_offsets(engine_sizes: list[int]) -> list[int]:
    """Group rank of each engine's first worker: the sender is rank 0, engine i's workers follow engine i-1's."""
    offsets, next_rank = [], 1
    for size in engine_sizes:
        offsets.append(next_rank)
        next_rank += size
    return offsets


def group_device(backend: str):
    """Where a group's buffers live: the current GPU for nccl, the CPU for gloo."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def new_weight_group(backend: str, init_method: str, world_size: int, rank: int, name: str, timeout_s: float):
    """This process's member of the group `name` (gloo or nccl); collectives on it fail after ``timeout_s``."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size, rank, [], dist.Backend(backend), PrefixStore(name, store), group_name=name, timeout=timeout,
    )
    # group ranks are their own global ranks here: broadcast(group_src=0) resolves through this map
    _world.pg_group_ranks[group] = {index: index for index in range(world_size)}
    return group
