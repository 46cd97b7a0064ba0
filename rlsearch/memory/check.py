"""The memory plan of a training config, and the check `rlsearch train` runs before anything starts."""

from __future__ import annotations

import math
from pathlib import Path

from ..config import ConfigError, TrainConfig, auto_dtype, check_model_dir
from ..devices import local_gpu_index
from .plan import GB, ActorMemorySettings, Device, EngineMemorySettings, Layout, MemoryInputs, MemoryPlan, plan_memory
from .shape import ModelShape
from .suggest import not_fitting_message

QUIET_BELOW = 0.75  # a plan that fits within this share of the memory says nothing at start-up


def host_memory() -> float:
    """The host's memory in bytes: MemTotal, or a lower cgroup limit (a container's)."""
    total = float("inf")
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            total = int(line.split()[1]) * 1024
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def detect_device(config: TrainConfig) -> Device | None:
    """The device an actor rank of this run computes on, as the driver sees it before Ray starts: its first GPU, else
    the host (trainer.device_memory_gb gives the size). None when it cannot be known: a driver without a GPU joining
    a cluster, without trainer.device_memory_gb."""
    given = config.trainer.device_memory_gb * GB
    gpu = local_gpu_index()
    if gpu is not None:
        import torch

        properties = torch.cuda.get_device_properties(gpu)
        if given:
            return Device("gpu", given, f"{properties.name}, trainer.device_memory_gb")
        return Device("gpu", float(properties.total_memory), properties.name)
    if config.trainer.ray_address:
        return Device("gpu", given, "the cluster's GPUs, trainer.device_memory_gb") if given else None
    if given:
        return Device("cpu", given, "host memory, trainer.device_memory_gb")
    return Device("cpu", host_memory(), "host memory")


def micro_batch_tokens(config: TrainConfig) -> int:
    """The most tokens one micro-batch of this run can hold: actor.max_tokens_per_microbatch, or fewer when a whole
    update's trajectories on one data-parallel rank cannot fill it (each at most the context window, or a window per
    turn when rollout.context folds or drops observations and starts new segments)."""
    rollout, algo, actor = config.rollout, config.algo, config.actor
    per_trajectory = rollout.window * (1 if rollout.context == "append" else rollout.max_turns)
    trajectories = math.ceil(config.data.batch_size * rollout.group_size / (algo.num_minibatches * actor.dp))
    return min(actor.max_tokens_per_microbatch, trajectories * per_trajectory)


def train_memory_inputs(config: TrainConfig, device: Device) -> MemoryInputs:
    """The plan's inputs from a training config (the model's config.json, the actor's layout and keys, the rollout's
    window and engines) for `device`."""
    actor, rollout = config.actor, config.rollout
    settings = ActorMemorySettings(
        tokens=micro_batch_tokens(config),
        layout=Layout(tp=actor.tp, pp=actor.pp, cp=actor.cp, dp=actor.dp, ep=actor.ep,
                      virtual_stages=actor.virtual_pipeline_stages),
        dtype=auto_dtype(config.model.dtype, device.kind == "gpu"),
        logits_chunk_tokens=actor.logits_chunk_tokens,
        # the recomputation and offloading keys (issue 46) read with their defaults where a config lacks them
        recompute=getattr(actor, "recompute", "none"),
        recompute_method=getattr(actor, "recompute_method", "uniform"),
        recompute_num_layers=getattr(actor, "recompute_num_layers", 1),
        recompute_modules=tuple(getattr(actor, "recompute_modules", ("core_attn",))),
        activation_offload=getattr(actor, "activation_offload", "none"),
        optimizer_offload_fraction=getattr(actor, "optimizer_offload_fraction", 0.0),
        distributed_optimizer=actor.use_distributed_optimizer,
        reference_model=config.algo.kl_coef > 0,
    )
    engines = EngineMemorySettings(
        count=rollout.num_engines, tp=rollout.tensor_parallel_size, kv_cache_gib=rollout.kv_cache_gib,
        gpu_memory_utilization=rollout.gpu_memory_utilization, window=rollout.window,
    )
    return MemoryInputs(ModelShape.from_model_dir(config.model.path), settings, device, engines)


def plan_train_config(config: TrainConfig, device: Device | None = None) -> MemoryPlan | None:
    """The plan of a training config on `device` (default: the one detected); None when the device is unknown."""
    device = device or detect_device(config)
    return None if device is None else plan_memory(train_memory_inputs(config, device))


def check_train_memory(config: TrainConfig) -> str:
    """The start-up check (trainer.memory_check): a line to print when the plan fits with little to spare (empty when
    it fits within QUIET_BELOW of the memory), is not checked or is only warned about; a ConfigError saying what
    would fit when it does not fit and the check is `error`."""
    mode = config.trainer.memory_check
    if mode == "off":
        return "[rlsearch] memory plan: not checked (trainer.memory_check=off)"
    check_model_dir(config.model.path)
    plan = plan_train_config(config)
    if plan is None:
        return ("[rlsearch] memory plan: not checked: this driver has no GPU and the cluster's are not visible before "
                "Ray starts; set trainer.device_memory_gb to their memory, or run `rlsearch plan --gpus N "
                "--gpu-memory-gb M`")
    if plan.fits:
        if plan.needed < QUIET_BELOW * plan.inputs.device.memory:
            return ""
        return f"[rlsearch] memory plan: {plan.headline()} of {plan.inputs.device.memory / GB:,.1f} GB: fits"
    message = f"the memory plan does not fit: {not_fitting_message(plan, config.rollout.window)}"
    if mode == "warn":
        return f"[rlsearch] warning: {message} (trainer.memory_check=warn: running anyway)"
    raise ConfigError(f"{message}. `rlsearch plan --config ...` prints the plan; trainer.memory_check=warn runs it "
                      f"anyway\n{plan.render()}")
