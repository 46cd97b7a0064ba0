"""The memory plan: what one actor rank (and a critic's beside it) and each rollout engine hold (weights, gradients,
optimizer states, saved activations, the logits chunk, the engines' KV cache) for a model, a layout and a trajectory
length, against the device's memory; what would fit when it does not; layouts for a number of GPUs.

Pure arithmetic over a few plain dataclasses (plan.py), with the per-token activation figures measured by
bench/memory.py (coefficients.py). check.py builds the inputs from a training config (where each part will run:
the driver's GPU and host, or a cluster's devices) and is the check every `rlsearch train` runs before anything
starts."""

from .check import (
    QUIET_BELOW,
    DriverMachine,
    PlanDevices,
    check_train_memory,
    driver_machine,
    plan_devices,
    plan_train_config,
    run_parts,
    train_memory_inputs,
    waits_for_cluster,
)
from .coefficients import coefficients_for
from .plan import (
    GB,
    ActorMemorySettings,
    CriticMemorySettings,
    Device,
    EngineMemorySettings,
    FrozenEngineSettings,
    HostPart,
    Layout,
    MemoryInputs,
    MemoryPlan,
    RankMemory,
    RunParts,
    ServerMemory,
    SharedDevice,
    plan_memory,
)
from .shape import ModelShape, StageParameters, stage_parameters
from .suggest import LayoutProposal, fitting_change, propose_layouts

__all__ = [
    "GB", "ActorMemorySettings", "CriticMemorySettings", "Device", "DriverMachine", "EngineMemorySettings",
    "FrozenEngineSettings", "HostPart",
    "Layout", "LayoutProposal", "MemoryInputs", "MemoryPlan", "ModelShape", "PlanDevices", "RankMemory", "RunParts",
    "ServerMemory", "SharedDevice", "StageParameters",
    "QUIET_BELOW", "check_train_memory", "coefficients_for", "driver_machine", "fitting_change", "plan_devices",
    "plan_memory", "plan_train_config", "propose_layouts", "run_parts", "stage_parameters", "train_memory_inputs",
    "waits_for_cluster",
]
