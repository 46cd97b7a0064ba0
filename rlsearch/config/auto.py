"""The keys whose `auto` depends on the devices of the run: made concrete once, at start-up, when the driver knows
whether the Ray cluster has GPUs (`rlsearch.ray_setup.cluster_has_gpus`), so that everything after it (actor ranks,
engines, checkpoints, the probe check) sees one concrete value. `rollout.enforce_eager` and `rollout.kv_cache_gib`
are not here: each engine decides those from its own device."""

from __future__ import annotations

from dataclasses import replace
from typing import TypeVar

T = TypeVar("T")


def auto_dtype(requested: str, has_gpus: bool) -> str:
    """model.dtype: auto -> bfloat16 with GPUs, float32 without."""
    if requested != "auto":
        return requested
    return "bfloat16" if has_gpus else "float32"


def auto_transport(requested: str, has_gpus: bool, delta: bool) -> str:
    """bridge.transport: auto -> broadcast (nccl) with GPUs, shm without or with delta syncs (bridge.delta)."""
    if requested != "auto":
        return requested
    return "broadcast" if has_gpus and not delta else "shm"


def resolve_auto_keys(config: T, has_gpus: bool) -> T:
    """A copy of `config` (any config with a model section; a training config also has bridge) with model.dtype and
    bridge.transport concrete."""
    changes = {"model": replace(config.model, dtype=auto_dtype(config.model.dtype, has_gpus))}
    if hasattr(config, "bridge"):
        bridge = config.bridge
        changes["bridge"] = replace(bridge, transport=auto_transport(bridge.transport, has_gpus, bridge.delta))
    return replace(config, **changes)
