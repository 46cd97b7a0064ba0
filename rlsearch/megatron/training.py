"""What makes a rank's model chunks trainable, and what a checkpoint of them holds: DDP wrapping, the optimizer and
LR schedule, and the distributed-checkpoint state (model, optimizer, scheduler, RNG states per rank)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import MethodType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..config import ActorConfig
from .cpu_compat import cuda_available
from .parallel import load_sharded, model_sharded_state, save_sharded


@dataclass
class TrainingModel:
    """A rank's model chunks wrapped for training, with their optimizer and LR scheduler."""

    chunks: list[torch.nn.Module]  # DistributedDataParallel, one per virtual pipeline stage
    optimizer: Any  # megatron.core.optimizer.MegatronOptimizer
    scheduler: Any  # megatron.core.optimizer_param_scheduler.OptimizerParamScheduler


def build_training_model(chunks: list[torch.nn.Module], actor: ActorConfig, total_steps: int) -> TrainingModel:
    """DDP around each chunk, Megatron's Adam, and the LR schedule over `total_steps` optimizer updates."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = chunks[0].config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=actor.use_distributed_optimizer,
    )
    model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk) for chunk in chunks]
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=actor.lr, min_lr=actor.min_lr, weight_decay=actor.weight_decay,
            adam_beta1=actor.adam_beta1, adam_beta2=actor.adam_beta2, clip_grad=actor.clip_grad,
            bf16=config.bf16, params_dtype=config.params_dtype,
            use_distributed_optimizer=actor.use_distributed_optimizer,
            optimizer_cpu_offload=actor.optimizer_offload_fraction > 0,
            optimizer_offload_fraction=actor.optimizer_offload_fraction,
        ),
        model,
    )
    use_fused_cpu_adam(optimizer)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if actor.lr_warmup_steps else actor.lr, max_lr=actor.lr,
        min_lr=actor.min_lr, lr_warmup_steps=actor.lr_warmup_steps,
        lr_decay_steps=max(total_steps, actor.lr_warmup_steps + 1),
        lr_decay_style=actor.lr_decay_style, start_wd=actor.weight_decay, end_wd=actor.weight_decay,
        wd_incr_steps=max(total_steps, 1), wd_incr_style="constant",
        # on resume only the step count comes from the checkpoint: the schedule is this run's config, so a
        # finished run continued with a larger trainer.total_steps re-plans its decay
        override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False,
    )
    return TrainingModel(model, optimizer, scheduler)


def use_fused_cpu_adam(optimizer: Any) -> None:
    """Without Apex or Transformer Engine Megatron steps torch's AdamW, whose default foreach path makes about ten
    passes over every parameter; on CPU its fused kernel makes one (10x faster over the tiny model's 39M parameters:
    the optimizer step was a tenth of a CPU training step). The same update up to float rounding. Only for torch's
    AdamW over CPU parameters: GPU steps keep Megatron's choice."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        adam = getattr(inner, "optimizer", None)
        if not isinstance(adam, torch.optim.AdamW):
            continue
        for group in adam.param_groups:
            if all(param.device.type == "cpu" for param in group["params"]):
                group["fused"], group["foreach"] = True, False


def save_training_state(training: TrainingModel, path: str) -> None:
    """Megatron distributed checkpoint (torch_dist) of model, optimizer, LR scheduler and this rank's RNG states into
    an existing empty dir. A collective."""
    dist.barrier()
    save_sharded(_sharded_state(training, is_loading=False, with_rng=True), path)
    dist.barrier()


_LOAD_REMEDY = ("its files are damaged, or it holds another model than the one built from model.path: resume from an "
                "intact checkpoint of this model (resume=auto checks every file's sha256 and skips a damaged one)")


def load_training_state(training: TrainingModel, path: str, restore_rng: bool) -> int:
    """Load a checkpoint written by `save_training_state` from any TP/PP/DP layout (Megatron reshards on load). RNG
    states are per rank, so they are restored only into the layout that saved them. Returns the scheduler's step
    count. A collective."""
    state = load_sharded(_sharded_state(training, is_loading=True, with_rng=restore_rng), path, _LOAD_REMEDY)
    with torch.no_grad():
        if len(training.chunks) == 1:
            training.chunks[0].module.load_state_dict(state["model"])
        else:
            for index, chunk in enumerate(training.chunks):
                chunk.module.load_state_dict(state["model"][f"model{index}"])
        training.optimizer.load_state_dict(state["optimizer"])
        _settle_loaded_optimizer(training.optimizer)
    use_fused_cpu_adam(training.optimizer)  # the loaded param groups carry the saving run's flags
    training.scheduler.num_steps = 0  # load_state_dict adds the saved count to the current one
    training.scheduler.load_state_dict(state["scheduler"])
    if restore_rng:
        _set_rng_state(state["rng"])
    dist.barrier()
    return training.scheduler.num_steps


def _sharded_state(training: TrainingModel, is_loading: bool, with_rng: bool) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    model_state = model_sharded_state(training.chunks)
    _fill_optimizer_gaps(training.optimizer)
    # the distributed optimizer's canonical (per-parameter) layout, so its state loads into any TP/PP/DP
    metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
    optimizer_state = training.optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=metadata)
    state = {
        "model": model_state,
        "optimizer": optimizer_state if is_loading else _without_classes(optimizer_state),
        "scheduler": training.scheduler.state_dict(),
    }
    if with_rng:
        layout = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
                  ps.get_data_parallel_world_size())
        position = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                    ps.get_data_parallel_rank())
        if ps.get_context_parallel_world_size() > 1:  # every CP rank has its own RNG states (without CP: same keys)
            layout += (ps.get_context_parallel_world_size(),)
            position += (ps.get_context_parallel_rank(),)
        state["rng"] = ShardedObject("rng_state", _rng_state(), layout, position, replica_id=0)
    return state


def _fill_optimizer_gaps(optimizer) -> None:
    """Gaps of megatron-core 0.16.1's distributed optimizer when it saves or loads, filled on each of ours:
    - with torch's Adam (its optimizer without Apex or Transformer Engine, whose fused Adam keeps `step` in its
      parameter groups rather than per parameter) it reads `step` from the state torch's Adam creates at its first
      step whenever it builds a state dict, so a fresh optimizer can neither save nor load (`assert len(steps) == 1`):
      the state is created as that step would (zeros at step 0); a load overwrites it, a save records step 0;
    - loading a fully_reshardable checkpoint copies every per-parameter state into place, torch's `step` included,
      which the checkpoint keeps in its parameter groups (KeyError: 'step'): every other state is copied, and one
      the checkpoint does not hold is refused;
    - after a load the hybrid optimizer of actor.optimizer_offload_fraction copies every parameter's master weights
      into its fp32 copy, and the distributed optimizer's fp32 main weights have none (KeyError): those with a copy.
    After a load: `_settle_loaded_optimizer`."""
    from megatron.core.optimizer import DistributedOptimizer, distrib_optimizer
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(part, DistributedOptimizer):
            continue
        part._set_main_param_and_optimizer_states = MethodType(_set_checkpointed_states, part)
        inner = part.optimizer
        if isinstance(inner, HybridDeviceOptimizer):
            inner._update_fp32_params_by_new_state = MethodType(_update_existing_fp32_copies, inner)
        if distrib_optimizer.HAVE_APEX_OR_TE or inner.state:
            continue
        for group in inner.param_groups:
            on_device = group.get("fused") or group.get("capturable")
            for param in group["params"]:
                inner.state[param] = {
                    "step": torch.zeros((), dtype=torch.float32, device=param.device if on_device else "cpu"),
                    "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                }


# the tensor of a fully_reshardable checkpoint each per-parameter state of the optimizer is loaded from (the hybrid
# optimizer's `master_param` is its copy of the main parameter); torch Adam's `step` is in the checkpoint's parameter
# groups instead, which the optimizer's load restores
_CHECKPOINT_TENSOR_OF_STATE = {"param": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq",
                               "master_param": "param"}
_STATES_IN_PARAMETER_GROUPS = ("step",)


def _set_checkpointed_states(self, model_param, tensors: dict) -> None:
    """DistributedOptimizer._set_main_param_and_optimizer_states (its path without a precision-aware optimizer):
    every state the optimizer holds for `model_param` but `step`, copied from `tensors` (the checkpoint's). A state
    that no checkpoint tensor is loaded into, a tensor the checkpoint lacks and one no state takes are a RuntimeError
    naming them, before anything is copied: they would be left as they were (a fresh optimizer's zeros), or dropped."""
    group_index, group_order = self.model_param_group_index_map[model_param]
    main_param = self.optimizer.param_groups[group_index]["params"][group_order]
    destination = {"param": main_param, **self.optimizer.state[main_param]}
    states = [key for key in destination if key not in _STATES_IN_PARAMETER_GROUPS]
    sources = {_CHECKPOINT_TENSOR_OF_STATE[key] for key in states if key in _CHECKPOINT_TENSOR_OF_STATE}
    problems = [f"the optimizer's state {key!r} is no tensor of a checkpoint" for key in states
                if key not in _CHECKPOINT_TENSOR_OF_STATE]
    problems += [f"the checkpoint has no {key!r} tensor" for key in sorted(sources - tensors.keys())]
    problems += [f"the checkpoint's {key!r} tensor is no state of this optimizer"
                 for key in sorted(tensors.keys() - sources)]
    if problems:
        raise RuntimeError(
            f"loading the distributed optimizer's states of {self._param_name(model_param)}: {'; '.join(problems)}. "
            "A checkpoint holds param, exp_avg and exp_avg_sq per parameter and step in its parameter groups (torch's "
            "Adam): resume it with the optimizer that wrote it")
    for key in states:
        destination[key].copy_(tensors[_CHECKPOINT_TENSOR_OF_STATE[key]])


def _update_existing_fp32_copies(self) -> None:
    """HybridDeviceOptimizer._update_fp32_params_by_new_state for the parameters it keeps an fp32 copy of."""
    for param, fp32_param in self.param_to_fp32_param.items():
        fp32_param.data.copy_(self.state[param]["master_param"])


def _without_classes(state):
    """`state` (nested dicts and lists) without the entries whose value is a class: the hybrid optimizer of
    actor.optimizer_offload_fraction names its sub-optimizers' classes in its parameter groups, and torch.load refuses
    classes in a checkpoint (weights_only) when a run resumes or the converter reads it. It keeps its own."""
    if isinstance(state, dict):
        return {key: _without_classes(value) for key, value in state.items() if not isinstance(value, type)}
    if isinstance(state, list):
        return [_without_classes(value) for value in state]
    return state


def _settle_loaded_optimizer(optimizer) -> None:
    """What megatron-core 0.16.1's distributed optimizer leaves unsettled after a load:
    - every parameter's torch-Adam state shares one `step` tensor, which torch's Adam then increments once per
      parameter at the next step (a wrong bias correction): each parameter gets its own;
    - the host copies of the hybrid optimizer (actor.optimizer_offload_fraction) still hold the main weights from
      before the load, which wrote the main weights themselves: they are copied again."""
    from megatron.core.optimizer import DistributedOptimizer
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(part, DistributedOptimizer):
            continue
        for state in part.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
        if isinstance(part.optimizer, HybridDeviceOptimizer):
            for host_copy, main_param in part.optimizer.cpu_copys_map_gpu_param.items():
                host_copy.data.copy_(main_param.data)


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if cuda_available() else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and cuda_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])
