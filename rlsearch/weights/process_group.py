"""The broadcast transport's process groups: one actor stage's sender (rank 0) and every worker of every engine.

These processes already belong to other default groups (Megatron's, each vLLM engine's TP group), so a group is
made outside the default world, from its own store: the sender opens it (`rlsearch.rendezvous`, a port bound when
chosen) and every member, the sender included, joins it. Every member must call `new_weight_group` at about the same
time: the rendezvous waits (at most ``timeout_s``) for all of them. Each member picks its backend from its own
devices (nccl with a GPU, gloo without) and the group checks they all picked the same.

A broadcast that cannot finish (a member died or hangs) fails after its own deadline on nccl as on gloo, the same
code: the collective runs asynchronously, the caller polls it, and past the deadline the group is aborted and
`CollectiveTimeout` raised. torch's own timeout is set well beyond, and on nccl the group is made without the
watchdog's tear-down (TORCH_NCCL_ASYNC_ERROR_HANDLING=0 while it is built), which would otherwise kill the
process: the sender (an actor rank) survives, the run restarts the dead engine and forms the groups again.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import torch

from ..devices import process_group_backend
from ..rendezvous import join_store

POLL_S = 0.001  # how often a waiting broadcast checks whether it finished
# torch's own collective timeout on a weight group, past ours: our deadline aborts the group first
TORCH_TIMEOUT_FACTOR = 4


class CollectiveTimeout(TimeoutError):
    """A weight group's collective did not finish within its deadline; the group was aborted (form a new one)."""


class MixedBackends(RuntimeError):
    """The members of a weight group are on different devices (some with GPUs, some without)."""


def rank_offsets(engine_sizes: list[int]) -> list[int]:
    """Group rank of each engine's first worker: the sender is rank 0, engine i's workers follow engine i-1's."""
    offsets, next_rank = [], 1
    for size in engine_sizes:
        offsets.append(next_rank)
        next_rank += size
    return offsets


def group_device(backend: str) -> torch.device:
    """Where a group's buffers live: the current GPU for nccl, the CPU for gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def new_weight_group(address: str, world_size: int, rank: int, name: str, timeout_s: float):
    """This process's member of the group `name` whose store was opened at `address`; its backend is this process's
    (`rlsearch.devices.process_group_backend`), the same on every member or MixedBackends on every member."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world

    backend = process_group_backend()
    store = PrefixStore(name, join_store(address, timeout_s))
    store.set(f"backend/{rank}", backend)
    backends = {store.get(f"backend/{member}").decode() for member in range(world_size)}
    if len(backends) > 1:
        raise MixedBackends(
            f"the weight group {name} mixes backends {sorted(backends)}: the actor's sender and the engine workers "
            "must all have GPUs (nccl) or none (gloo); use weights.transport=shm otherwise"
        )
    with _without_watchdog_teardown(backend):
        group, _ = _new_process_group_helper(
            world_size, rank, [], dist.Backend(backend), PrefixStore("group", store), group_name=name,
            timeout=timedelta(seconds=TORCH_TIMEOUT_FACTOR * timeout_s),
        )
    # group ranks are their own global ranks here: broadcast(group_src=0) resolves through this map
    _world.pg_group_ranks[group] = {index: index for index in range(world_size)}
    return group


def broadcast_within(flat: torch.Tensor, group, timeout_s: float) -> None:
    """Broadcast `flat` from the group's rank 0 (the sender sends it, the others receive into it), failing after
    `timeout_s`: the group is then aborted and CollectiveTimeout raised. A failed collective raises its error."""
    import torch.distributed as dist

    work = dist.broadcast(flat, group_src=0, group=group, async_op=True)
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            abort_weight_group(group)
            raise CollectiveTimeout(f"a weight broadcast did not finish within {timeout_s:g} s; its group is aborted")
        time.sleep(POLL_S)
    work.wait()


def abort_weight_group(group) -> None:
    """Abort the group's communication (freeing a collective stuck in it) and forget the group."""
    from torch.distributed.distributed_c10d import _abort_process_group, _world

    if group in _world.pg_map:
        _abort_process_group(group)


def destroy_weight_group(group) -> None:
    """Leave a group, whether it is whole or was aborted."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    if group in _world.pg_map:
        dist.destroy_process_group(group)


_ENVIRONMENT_LOCK = threading.Lock()


@contextmanager
def _without_watchdog_teardown(backend: str):
    """While a nccl group is built: TORCH_NCCL_ASYNC_ERROR_HANDLING=0, which that group reads once, so that a
    collective past torch's timeout is left to our deadline instead of tearing the process down."""
    if backend != "nccl":
        yield
        return
    with _ENVIRONMENT_LOCK:
        saved = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
        try:
            yield
        finally:
            if saved is None:
                del os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
            else:
                os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = saved
