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


_UNPICKLER_MARKER = "WeightsUnpickler error:"


class CheckpointLoadError(RuntimeError):
    """A Megatron checkpoint that could not be loaded; the message names the checkpoint and each rank's error."""


def load_sharded(state: dict, path: str, remedy: str) -> dict:
    """Megatron's `dist_checkpointing.load` of `state` from `path`. A collective. torch reports a failed load as
    `CheckpointException ranks:dict_keys([0])`, its causes in a dict: they are told in a CheckpointLoadError, with
    `remedy` (what to do)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return dist_checkpointing.load(state, path)
    except (CheckpointingException, CheckpointException) as error:
        raise CheckpointLoadError(f"cannot load the checkpoint {path} ({load_failures(error)}); {remedy}") from None


def load_failures(error: BaseException) -> str:
    """'rank R: Type: message' for each rank's root error in a torch CheckpointException (its `failures`: rank ->
    (exception, traceback)), else the error's own; torch's advice to load with weights_only=False is left out."""
    failures = getattr(error, "failures", None) or {None: error}
    told = []
    for rank, failure in sorted(failures.items(), key=lambda item: -1 if item[0] is None else item[0]):
        root = failure[0] if isinstance(failure, tuple) else failure
        while root.__cause__ is not None:
            root = root.__cause__
        message = str(root)
        # torch.load's weights_only refusal: its cause sits between this marker and the link to the docs
        unpickled = message.partition(_UNPICKLER_MARKER)[2].partition("Check the documentation")[0]
        message = next((line.strip() for line in (unpickled or message).splitlines() if line.strip()), "")
        told.append(("" if rank is None else f"rank {rank}: ") + f"{type(root).__name__}: {message}")
    return "; ".join(told)


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
