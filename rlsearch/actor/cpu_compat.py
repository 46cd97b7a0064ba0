"""Everything megatron-core 0.16.1 needs to run on a CPU-only torch with gloo, in one place.

`apply_cpu_patches()` is a no-op in a process with a GPU: the GPU path runs megatron unpatched.
What each patch covers (megatron-cpu.md has the investigation):
- RNG tracker: CudaRNGStatesTracker.add/fork call torch.cuda.get_rng_state(); ours keeps CPU generator states.
- Device mode: hard-coded device="cuda" / .cuda() across megatron (schedules, causal masks) become CPU. The
  TorchFunctionMode is thread-local: enter it on the thread that calls megatron (a sync Ray actor runs
  __init__ and every method on the main thread).
- torch.cuda.current_device() -> 0 and torch.cuda.synchronize() -> no-op (rotary embedding, checkpoint save).
- Tensor.type() reports 'torch.cuda.*' (the distributed optimizer and grad clipping assert on it).
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

from ..devices import local_gpu_index

_applied = False
_mode_threads: set[int] = set()


def cuda_available() -> bool:
    """Whether this process computes on a GPU (`rlsearch.devices.local_gpu_index`)."""
    return local_gpu_index() is not None


def apply_cpu_patches() -> None:
    """Patch megatron for CPU (idempotent) and enter the device mode on the calling thread."""
    global _applied
    if cuda_available():
        return
    if not _applied:
        _install_cpu_rng_tracker()
        torch.cuda.current_device = lambda: 0
        torch.cuda.synchronize = lambda *args, **kwargs: None
        _applied = True
    if threading.get_ident() not in _mode_threads:
        _CudaToCpuMode().__enter__()
        _mode_threads.add(threading.get_ident())


def _as_cpu_device(device):
    if isinstance(device, bool):
        return device
    if isinstance(device, int):  # a bare index means cuda:<index> to torch factories
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaToCpuMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _as_cpu_device(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], (torch.dtype, torch.Tensor)):
            args = (args[0], _as_cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


def _install_cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as megatron_random

    class CpuRNGStatesTracker(megatron_random.CudaRNGStatesTracker):
        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

        @contextlib.contextmanager
        def fork(self, name=megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            saved = torch.get_rng_state()
            previous_name = self._current_state_name
            if previous_name != "default-rng":
                self.states_[previous_name] = saved
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if previous_name != "default-rng":
                    saved = self.states_[previous_name]
                torch.set_rng_state(saved)
                self._current_state_name = previous_name

    megatron_random.CudaRNGStatesTracker = CpuRNGStatesTracker
    megatron_random.initialize_rng_tracker(force_reset=True)
