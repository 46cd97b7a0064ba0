"""Device memory handed back between a model's turns (critic.offload: the actor and the critic take turns on the
same devices): every storage of a rank's model chunks, gradient buffers and optimizer states is copied to host
memory and released, then restored in place. Storages, not tensors: parameters and gradients are views into
Megatron's contiguous buffers, and a storage resized back under them keeps every view valid. The same code runs on a
CPU rank (host to host: the memory is freed and held again), which the tests check bit for bit."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def training_storages(chunks: Iterable[torch.nn.Module], optimizer: Any = None) -> list[torch.UntypedStorage]:
    """The distinct non-empty storages of the chunks' parameters and gradient buffers (DDP's param and grad data,
    each parameter's main_grad) and of the optimizer's main parameters and states."""
    tensors: list[torch.Tensor] = []
    for chunk in chunks:
        for buffer in [*getattr(chunk, "buffers", []), *getattr(chunk, "expert_parallel_buffers", [])]:
            tensors += [data for data in (getattr(buffer, "param_data", None), buffer.grad_data) if data is not None]
        for parameter in chunk.parameters():
            tensors += [parameter.data, *([parameter.main_grad] if getattr(parameter, "main_grad", None) is not None
                                          else [])]
    for part in getattr(optimizer, "chained_optimizers", [optimizer] if optimizer is not None else []):
        inner = part.optimizer
        tensors += [param for group in inner.param_groups for param in group["params"]]
        tensors += [value for state in inner.state.values() for value in state.values()
                    if isinstance(value, torch.Tensor)]
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            storages.setdefault(storage.data_ptr(), storage)
    return list(storages.values())


def release(storages: list[torch.UntypedStorage]) -> list[tuple[torch.UntypedStorage, torch.Tensor]]:
    """Each storage's bytes copied to host memory (pinned next to a GPU), then the storage emptied: (storage, host
    copy) pairs for `restore`."""
    copies = []
    for storage in storages:
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
        host.copy_(_as_bytes(storage))
        storage.resize_(0)
        copies.append((storage, host))
    if any(storage.device.type == "cuda" for storage, _ in copies):
        torch.cuda.empty_cache()  # the released blocks back to the device, for the other model
    return copies


def restore(copies: list[tuple[torch.UntypedStorage, torch.Tensor]]) -> None:
    """The storages `release` emptied, at their size again with their bytes back (every view of them valid)."""
    for storage, host in copies:
        storage.resize_(host.numel())
        _as_bytes(storage).copy_(host)


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
