"""What a process computes with, decided in that process from the devices it sees: its GPU (or none), its
torch.distributed backend, and whether Transformer Engine's torch part is usable. A Ray worker sees the GPUs Ray gave
it, which the driver (possibly a CPU-only head node) does not: the driver asks the cluster instead
(`rlsearch.ray_setup.cluster_has_gpus`).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

# the second install step of the GPU stack (scripts/setup.sh): Transformer Engine's torch extension must be built for
# the torch that is installed, which build isolation would replace by the newest one
TRANSFORMER_ENGINE_INSTALL = "pip install --no-build-isolation -r requirements/gpu-te.txt"
# the CPU cores a run's processes share (default: all those this process may use), for a run beside others on one
# machine: the test suite's lanes each get their share. Two processes each running as many threads as the machine has
# cores take twice as long as with one thread each (a tiny model's training steps, 2 cores)
CPU_CORES_VARIABLE = "RLSEARCH_CPU_CORES"
# a cgroup v2 CPU quota, as a container sees its own cgroup ("max" or "quota period", in microseconds)
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def cpu_cores(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The CPU cores this run's processes share: RLSEARCH_CPU_CORES where it is set, else those this process may use
    (`usable_cpu_cores`)."""
    value = os.environ.get(CPU_CORES_VARIABLE, "")
    if not value:
        return usable_cpu_cores(cpu_max)
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{CPU_CORES_VARIABLE}={value!r}: set it to a whole number of cores (at least 1), or unset it")
    return int(value)


def usable_cpu_cores(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The cores this process may run on (its CPU affinity: a container's cpuset, taskset), fewer where its cgroup's
    CPU quota allows fewer. os.cpu_count() counts the host's: a 4-CPU container on a 64-core host would run 64
    threads per process."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_quota(cpu_max)
    return min(cores, quota) if quota else cores


def cgroup_cpu_quota(cpu_max: Path = CGROUP_CPU_MAX) -> int | None:
    """The cores a cgroup v2 CPU quota allows (cpu.max's "quota period", quota / period rounded up); None where there
    is none: "max", or no readable cpu.max (cgroup v1, not Linux)."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota == "max":
            return None
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError, ZeroDivisionError):
        return None


def cpu_threads_each(processes: int) -> int:
    """torch threads for each of `processes` processes that compute side by side on the run's CPU cores."""
    return max(1, cpu_cores() // processes)


def local_gpu_index() -> int | None:
    """The index (in this process's CUDA numbering) of the GPU it computes on; None when it has none.

    A Ray worker uses the GPU Ray assigned it (the first, for an actor given several): device 0 when Ray narrowed
    CUDA_VISIBLE_DEVICES to its assignment (Ray's default), its position among the visible devices when Ray left
    them all visible (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1). A Ray worker assigned no GPU uses none, even
    where GPUs are visible. Any other process (torchrun, a spawned converter rank, a script) uses LOCAL_RANK."""
    if not torch.cuda.is_available():
        return None
    assigned = _ray_gpu_ids()
    if assigned is None:
        return int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
    if not assigned:
        return None
    visible = [device.strip() for device in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if device.strip()]
    if not visible:
        return min(int(gpu) for gpu in assigned)
    missing = [str(gpu) for gpu in assigned if str(gpu) not in visible]
    if missing:
        raise RuntimeError(
            f"Ray assigned this worker GPU {', '.join(missing)} but CUDA_VISIBLE_DEVICES={','.join(visible)} does not "
            "list it: start the Ray nodes with the CUDA_VISIBLE_DEVICES they should use, and do not set it per worker"
        )
    return min(visible.index(str(gpu)) for gpu in assigned)


def gpu_name_and_memory(index: int) -> tuple[str, int]:
    """The name and total memory in bytes of GPU `index` (this process's CUDA numbering: CUDA_VISIBLE_DEVICES
    applied), from NVML, the driver's management library. Nothing of CUDA starts in this process: torch's
    get_device_properties would initialise it, and a driver that has cannot fork processes that use CUDA. OSError
    when NVML does not load, RuntimeError when it cannot tell."""
    import ctypes

    nvml = ctypes.CDLL("libnvidia-ml.so.1")

    def call(function: str, *args) -> None:
        status = getattr(nvml, function)(*args)
        if status:
            raise RuntimeError(f"NVML's {function} returned {status}")

    class Memory(ctypes.Structure):
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    visible = [device.strip() for device in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if device.strip()]
    device = visible[index] if visible else str(index)  # an NVML index, or a GPU's or MIG instance's UUID
    call("nvmlInit_v2")
    try:
        handle = ctypes.c_void_p()
        if device.isdigit():
            call("nvmlDeviceGetHandleByIndex_v2", ctypes.c_uint(int(device)), ctypes.byref(handle))
        else:
            call("nvmlDeviceGetHandleByUUID", device.encode(), ctypes.byref(handle))
        name = ctypes.create_string_buffer(96)
        call("nvmlDeviceGetName", handle, name, ctypes.c_uint(len(name)))
        memory = Memory()
        call("nvmlDeviceGetMemoryInfo", handle, ctypes.byref(memory))
    finally:
        nvml.nvmlShutdown()
    return name.value.decode(), memory.total


def local_device() -> torch.device:
    index = local_gpu_index()
    return torch.device("cpu") if index is None else torch.device("cuda", index)


def process_group_backend() -> str:
    """nccl where this process has a GPU, gloo where it does not."""
    return "gloo" if local_gpu_index() is None else "nccl"


def _ray_gpu_ids() -> list | None:
    """The GPU ids Ray assigned this process; None when it is not a Ray worker (the driver, or no Ray at all)."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized() or ray.get_runtime_context().worker.mode != ray.WORKER_MODE:
        return None
    return list(ray.get_gpu_ids())


@dataclass(frozen=True)
class TransformerEngineStatus:
    state: str  # ok | absent | broken
    detail: str = ""  # ok: the version; broken: why transformer_engine.pytorch does not import

    def problem(self) -> str:
        """What is wrong and what to do (empty when ok)."""
        if self.state == "absent":
            return f"Transformer Engine is not installed; install it with `{TRANSFORMER_ENGINE_INSTALL}`"
        if self.state == "broken":
            return (f"Transformer Engine is installed but transformer_engine.pytorch does not import ({self.detail}): "
                    "its torch extension does not match the installed torch. Reinstall it against that torch: "
                    f"`{TRANSFORMER_ENGINE_INSTALL}`")
        return ""


def transformer_engine_status() -> TransformerEngineStatus:
    """Whether Transformer Engine's torch part imports. ``import transformer_engine`` alone proves nothing: its
    top-level package swallows the ImportError of a torch extension built for another torch, after which Megatron
    quietly stands in mocks for every TE layer."""
    if importlib.util.find_spec("transformer_engine") is None:
        return TransformerEngineStatus("absent")
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as error:  # an ImportError, or an OSError from a CUDA library that does not load
        return TransformerEngineStatus("broken", f"{type(error).__name__}: {error}")
    return TransformerEngineStatus("ok", getattr(importlib.import_module("transformer_engine"), "__version__", ""))
