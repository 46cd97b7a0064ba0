"""The rollout side of a run, started the same way by training and eval: the local tool servers first (their URLs go
into the tools config the engines get), then the engines."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..config import ConfigError, ModelConfig, RolloutConfig, ToolsConfig
from ..tools import ToolServers, ToolSetupError
from .engine import EngineSpec
from .frozen import start_frozen_summariser
from .pool import EnginePool


def start_tool_servers(tools: ToolsConfig) -> ToolServers:
    """The local servers `tools` needs, started; `.tools` is the config with their URLs. A set-up problem (a missing
    corpus, a server that does not come up) is a ConfigError that names it."""
    try:
        return ToolServers(tools).start()
    except ToolSetupError as error:
        raise ConfigError(str(error)) from error


def start_engines(model: ModelConfig, rollout: RolloutConfig, tools: ToolsConfig, seed: int, lora_rank: int = 0,
                  helpers: Sequence[Any] = (), **pool_options: Any) -> EnginePool:
    """`rollout.num_engines` engines of `model` as Ray actors (Ray already running), with the tools of `tools` (the
    started servers' config) and, with `lora_rank`, vLLM's LoRA on (actor.lora.sync=adapter); `pool_options` place
    them (trainer.placement). The frozen engine of the browse summariser (tools.browse.summariser.engine) starts
    first; it and `helpers` (frozen engines the caller started, e.g. `start_frozen_judge`'s) stop with the pool, or
    are stopped here when the pool does not start."""
    import ray

    from ..ray_setup import cluster_has_gpus

    frozen = list(helpers)
    try:
        tools, summariser = start_frozen_summariser(tools, seed, gpus=1 if cluster_has_gpus() else 0)
        frozen += [summariser] if summariser is not None else []
        pool = EnginePool(EngineSpec.from_config(model, rollout, seed, lora_rank), rollout, tools, seed, **pool_options)
    except BaseException:
        for actor in frozen:
            ray.kill(actor)
        raise
    pool.helpers += frozen
    return pool
