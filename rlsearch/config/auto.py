"""The keys whose `auto` depends on the run, made concrete once at start-up so that everything after it sees one
value. The devices: when the driver knows whether the Ray cluster has GPUs (`rlsearch.ray_setup.cluster_has_gpus`),
for actor ranks, engines, checkpoints and the probe check (`rollout.enforce_eager` and `rollout.kv_cache_gib` are not
here: each engine decides those from its own device). The output dir: where the run keeps its tool results and judge
replies."""

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
    """weights.transport: auto -> broadcast (nccl) with GPUs, shm without or with delta syncs (weights.delta)."""
    if requested != "auto":
        return requested
    return "broadcast" if has_gpus and not delta else "shm"


def resolve_auto_keys(config: T, has_gpus: bool) -> T:
    """A copy of `config` (any config with a model section; a training config also has weights) with model.dtype and
    weights.transport concrete."""
    changes = {"model": replace(config.model, dtype=auto_dtype(config.model.dtype, has_gpus))}
    if hasattr(config, "weights"):
        weights = config.weights
        changes["weights"] = replace(weights, transport=auto_transport(weights.transport, has_gpus, weights.delta))
    return replace(config, **changes)


def store_dir(cache_dir: str) -> str | None:
    """The directory a tool store or judge cache lives in; None for none: empty, or `auto` outside a run (a run
    resolves it with `resolve_store_dirs`)."""
    return cache_dir if cache_dir not in ("", "auto") else None


def resolve_store_dirs(config: T, output_dir: str) -> T:
    """A copy of `config` (any config with tools and reward sections) whose tools.cache_dir and
    reward.judge.cache_dir of `auto` are the run's stores: <output_dir>/tool_store and <output_dir>/judge_cache."""
    tools, judge = config.tools, config.reward.judge
    return replace(
        config,
        tools=replace(tools, cache_dir=f"{output_dir}/tool_store" if tools.cache_dir == "auto" else tools.cache_dir),
        reward=replace(config.reward, judge=replace(
            judge, cache_dir=f"{output_dir}/judge_cache" if judge.cache_dir == "auto" else judge.cache_dir)),
    )
