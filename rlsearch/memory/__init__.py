"""The memory plan: what one actor rank and each rollout engine hold (weights, gradients, optimizer states, saved
activations, the logits chunk, the engines' KV cache) for a model, a layout and a trajectory length, against the
device's memory; what would fit when it does not; layouts for a number of GPUs.

Pure arithmetic over a few plain dataclasses (plan.py), with the per-token activation figures measured by
bench/memory.py (coefficients.py). check.py builds the inputs from a training config and is the check every
`rlsearch train` runs before anything starts."""

from .check import QUIET_BELOW, check_train_memory, detect_device, plan_train_config, train_memory_inputs
from .coefficients import coefficients_for
from .plan import (
    GB,
    ActorMemorySettings,
    Device,
    EngineMemorySettings,
    Layout,
    MemoryInputs,
    MemoryPlan,
    RankMemory,
    plan_memory,
)
from .shape import ModelShape, StageParameters, stage_parameters
from .suggest import LayoutProposal, fitting_change, propose_layouts

__all__ = [
    "GB", "ActorMemorySettings", "Device", "EngineMemorySettings", "Layout", "LayoutProposal", "MemoryInputs",
    "MemoryPlan", "ModelShape", "RankMemory", "StageParameters",
    "QUIET_BELOW", "check_train_memory", "coefficients_for", "detect_device", "fitting_change", "plan_memory",
    "plan_train_config",
    "propose_layouts", "stage_parameters", "train_memory_inputs",
]
