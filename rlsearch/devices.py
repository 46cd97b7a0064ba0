"""The device a process computes on and the torch.distributed backend it uses, decided in that process from the
devices it sees: a Ray worker sees the GPUs Ray gave it, which the driver (possibly a CPU-only head node) does not.
"""

from __future__ import annotations

import os

import torch


def local_gpu_index() -> int | None:
    """The index (in this process's CUDA numbering) of the GPU it should use; None without a GPU.

    A Ray worker uses the first GPU Ray assigned it: device 0 when Ray set CUDA_VISIBLE_DEVICES to the assignment,
    its position among the visible devices otherwise (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1). A process
    started by torchrun uses LOCAL_RANK."""
    if not torch.cuda.is_available():
        return None
    assigned = _ray_gpu_ids()
    if assigned:
        visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        first = str(assigned[0])
        if first in visible:
            return visible.index(first)
        return 0 if visible else int(first)
    return int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()


def local_device() -> torch.device:
    index = local_gpu_index()
    return torch.device("cpu") if index is None else torch.device("cuda", index)


def process_group_backend() -> str:
    """nccl where this process has a GPU, gloo where it does not."""
    return "gloo" if local_gpu_index() is None else "nccl"


def _ray_gpu_ids() -> list:
    try:
        import ray
    except ImportError:
        return []
    if not ray.is_initialized():
        return []
    try:
        return list(ray.get_gpu_ids())
    except Exception:  # the driver, or a process outside a Ray worker
        return []
