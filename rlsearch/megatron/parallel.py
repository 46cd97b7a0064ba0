"""Process-group and Megatron parallel-state set-up, shared by the actor ranks and the checkpoint converter."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ..devices import local_gpu_index, process_group_backend
from ..rendezvous import join_store
from .cpu_compat import apply_cpu_patches, define_missing_te_names

PROCESS_GROUP_TIMEOUT_S = 600.0  # the ranks' rendezvous and collectives


def init_megatron_parallel(
    rank: int,
    world_size: int,
    rendezvous: str,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    virtual_pipeline_stages: int = 0,
    backend: str = "auto",
    seed: int = 0,
) -> str:
    """Join the process group whose store was opened at `rendezvous` ("host:port", rlsearch.rendezvous; `auto`
    backend: nccl where this rank has a GPU, gloo where it has none) and initialise
    Megatron's parallel state and RNG streams. On CPU the Megatron compatibility patches are applied first. Returns
    the backend used."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    define_missing_te_names()
    gpu = local_gpu_index()
    if gpu is None:
        apply_cpu_patches()
    else:
        torch.cuda.set_device(gpu)
    if backend == "auto":
        backend = process_group_backend()
    dist.init_process_group(
        backend=backend, store=join_store(rendezvous, PROCESS_GROUP_TIMEOUT_S), rank=rank, world_size=world_size,
        timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
    )
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        virtual_pipeline_model_parallel_size=virtual_pipeline_stages or None, expert_model_parallel_size=ep,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return backend


def model_sharded_state(chunks: list[torch.nn.Module]) -> dict:
    """Megatron's sharded state dict of a rank's model chunks (bare GPTModels or DDP-wrapped). Tensor keys are
    global, so a checkpoint written from one TP/PP/VPP layout loads into any other."""
    modules = [getattr(chunk, "module", chunk) for chunk in chunks]
    if len(modules) == 1:
        return modules[0].sharded_state_dict()
    return {f"model{i}": module.sharded_state_dict() for i, module in enumerate(modules)}


def save_sharded(state: dict, path: str) -> None:
    """Megatron's `dist_checkpointing.save` of `state` into `path` (an existing empty dir). A collective.

    Its writer hands its results back through a queue it makes once per process from a spawned Manager: a server
    process that starts Python and imports torch anew (~9 CPU-seconds and a process kept per rank, at the rank's first
    save). A synchronous save puts its results in the queue and takes them out in this process (its forked writers
    report through queues of their own), so an in-process queue does."""
    import queue

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    dist_checkpointing.save(state, path)
