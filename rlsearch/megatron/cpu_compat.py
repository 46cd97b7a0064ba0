"""Everything megatron-core 0.16.1 needs to run on a CPU-only torch with gloo, in one place.

`apply_cpu_patches()` is a no-op in a process with a GPU: the GPU path runs megatron unpatched.
What each patch covers (megatron-cpu.md has the investigation):
- RNG tracker: CudaRNGStatesTracker.add/fork call torch.cuda.get_rng_state(); ours keeps CPU generator states. The
  activation checkpointing (actor.recompute: CheckpointFunction, CheckpointWithoutOutput) saves "the CUDA RNG state"
  before a recomputed forward and restores it for the recomputation: the CPU generator is that state here.
- Device mode: hard-coded device="cuda" / .cuda() across megatron (schedules, causal masks) become CPU. The
  TorchFunctionMode is thread-local: enter it on the thread that calls megatron (a sync Ray actor runs
  __init__ and every method on the main thread).
- torch.cuda.current_device() -> 0 and torch.cuda.synchronize() -> no-op (rotary embedding, checkpoint save).
- Tensor.type() reports 'torch.cuda.*' (the distributed optimizer and grad clipping assert on it).
- Backward passes: the device mode is not active inside autograd `Function.backward` (the engine runs it under the
  thread-local state of the graph, without torch-function modes), so every custom backward runs inside the mode too
  (megatron's `_gather_along_first_dim` allocates with device=torch.cuda.current_device() there).
- Optimizer offload (actor.optimizer_offload_fraction): Megatron's HybridDeviceOptimizer splits the parameters by
  `is_cuda` and gives a share of the GPU-resident ones a host copy (pinned) updated by a CPU optimizer; with no
  parameter on a GPU it offloads nothing and then fails its first step. Here the model's parameters stand for the
  GPU-resident ones, so the split, the host copies, their updates and the copy back run as on a GPU; pinning memory
  is a no-op.
- Gradient norm (what optimizer.step() returns and clips by): without Apex or Transformer Engine Megatron takes
  torch.norm of each gradient, and torch's CPU 2-norm kernel adds the float32 squares into float32 accumulators
  (pytorch#169237), short by more the larger the tensor: 5.8e-4 of the squared norm of the tests' 16,512 x 128 output
  layer's gradient, 4e-3 of a 33M-element one's. A TP2 rank's half of it is short by less, so TP1 and TP2 reported
  other norms of the same gradients (1.00784 and 1.00786; 1.00790 both). Ours sums the squares in float64.
- MoE (megatron-core 0.16.1, local spec, SequentialMLP; ../shared/reference/moe_cpu): the alltoall dispatcher makes a
  `torch.cuda.Stream()` and synchronises its device-to-host copy through CUDA streams and events; and it hands its
  split sizes to `all_to_all_single` as numpy arrays made by a helper that converts only CUDA tensors.

`define_missing_te_names()` runs on GPUs too: megatron-core 0.16.1's MoE router reads `moe_utils.te_general_gemm`,
which is defined only when Transformer Engine imports, so a MoE model without Transformer Engine fails its first
forward with a NameError on a GPU as on a CPU (seen on an H100); and its CheckpointWithoutOutput (selective
recomputation of the norms) asks Transformer Engine whether fp8 is on even when fp8 is off.
"""

from __future__ import annotations

import contextlib
import math
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
        _run_backward_in_device_mode()
        _patch_grad_norm()
        _patch_moe()
        _patch_optimizer_offload()
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
        if kwargs.get("pin_memory"):  # page-locked memory is for copies to a GPU (and needs its driver)
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], (torch.dtype, torch.Tensor)):
            args = (args[0], _as_cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


def _run_backward_in_device_mode() -> None:
    from torch.autograd.function import BackwardCFunction

    apply_backward = BackwardCFunction.apply

    def apply_in_device_mode(self, *args):
        with _CudaToCpuMode():
            return apply_backward(self, *args)

    BackwardCFunction.apply = apply_in_device_mode


class _NoopEvent:
    def synchronize(self) -> None:
        pass

    def wait(self, *args, **kwargs) -> None:
        pass


class _NoopStream:
    """Stands in for the alltoall dispatcher's CUDA stream: CPU copies are synchronous."""

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def record_event(self, *args, **kwargs) -> _NoopEvent:
        return _NoopEvent()

    def synchronize(self) -> None:
        pass


_NOOP_STREAM = _NoopStream()


def define_missing_te_names() -> None:
    """Megatron's Transformer Engine names that its code reads without checking they exist, as None (its own "no
    Transformer Engine" value) where Transformer Engine is not installed."""
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if not megatron_random.HAVE_TE and not getattr(megatron_random.CheckpointWithoutOutput, "_fp8_fixed", False):
        # its __init__ sets `self.fp8 = fp8 is not None`, True for the default fp8=False, and its forward then reads
        # Transformer Engine's FP8GlobalStateManager: selective recomputation of the norms (actor.recompute_modules
        # layernorm) failed with a NameError without Transformer Engine
        init = megatron_random.CheckpointWithoutOutput.__init__

        def without_fp8(self, fp8=False):
            init(self, fp8)
            self.fp8 = False

        megatron_random.CheckpointWithoutOutput.__init__ = without_fp8
        megatron_random.CheckpointWithoutOutput._fp8_fixed = True


def _patch_grad_norm() -> None:
    from megatron.core.optimizer import clip_grads

    clip_grads.l2_norm_impl = _l2_norm_summed_in_float64


_NORM_CHUNK_ELEMENTS = 1 << 20  # the float64 copy of a chunk: 8 MB


def _l2_norm_summed_in_float64(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron.core.utils.local_multi_tensor_l2_norm (the 2-norm of all the tensors of tensor_lists[0] together, a
    float32 tensor [1], no per-tensor norms) with the squares summed in float64, a chunk of each tensor at a time."""
    squares = 0.0
    for tensor in tensor_lists[0]:
        for chunk in tensor.detach().reshape(-1).split(_NORM_CHUNK_ELEMENTS):
            squares += float(torch.linalg.vector_norm(chunk, dtype=torch.float64)) ** 2
    return torch.tensor([math.sqrt(squares)], dtype=torch.float32), None


def _patch_moe() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    # a class attribute the dispatcher's __init__ only fills when unset; torch.cuda.Stream itself stays a class
    # (transformers names it in type annotations)
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NOOP_STREAM
    torch.cuda.current_stream = lambda *args, **kwargs: _NOOP_STREAM
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    move_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu

    def move_to_cpu_as_numpy_too(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return move_to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = move_to_cpu_as_numpy_too


def _patch_optimizer_offload() -> None:
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    HybridDeviceOptimizer._get_sub_optimizer_param_groups = _split_with_the_parameters_on_the_device


def _split_with_the_parameters_on_the_device(self, offload_fraction: float):
    """HybridDeviceOptimizer._get_sub_optimizer_param_groups (megatron-core 0.16.1) with every parameter counted as
    GPU-resident (the original tests `is_cuda`): the first parameters up to `offload_fraction` of the elements get a
    host copy (a CPU optimizer's), the others stay with the device optimizer; fp32 copies of low-precision ones."""
    total = sum(param.numel() for group in self.param_groups for param in group["params"])
    threshold, offloaded = total * offload_fraction, 0
    cpu_groups, device_groups, to_copy, to_parameter, fp32_copies = [], [], {}, {}, {}
    for group in self.param_groups:
        cpu_group, device_group = {**group, "params": []}, {**group, "params": []}
        for original in group["params"]:
            param, copied = original, offloaded < threshold
            if copied:
                param = original.detach().clone()
                offloaded += param.numel()
            if self.param_update_in_fp32 and param.dtype != torch.float32:
                param = param.detach().clone().float()
                fp32_copies[original] = param
            if copied:
                to_copy[original], to_parameter[param] = param, original
            (cpu_group if copied else device_group)["params"].append(param)
        device_groups += [device_group] if device_group["params"] else []
        cpu_groups += [cpu_group] if cpu_group["params"] else []
    return cpu_groups, device_groups, to_copy, to_parameter, fp32_copies


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
    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
