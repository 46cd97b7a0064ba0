"""Structured configs: dataclass schemas, YAML + dotted overrides, validation with errors naming the key."""

from .loader import ConfigError, from_dict, load_config, to_dict
from .schema import (
    ActorConfig,
    AlgoConfig,
    BridgeConfig,
    DataConfig,
    ModelConfig,
    RetrieverConfig,
    RewardConfig,
    RolloutConfig,
    ToolsConfig,
    TrainConfig,
    TrainerConfig,
)
from .validate import validate_train_config


def load_train_config(path: str | None, overrides: list[str] | None = None) -> TrainConfig:
    return validate_train_config(load_config(TrainConfig, path, overrides))


__all__ = [
    "ActorConfig", "AlgoConfig", "BridgeConfig", "ConfigError", "DataConfig", "ModelConfig", "RetrieverConfig",
    "RewardConfig", "RolloutConfig", "ToolsConfig", "TrainConfig", "TrainerConfig", "from_dict", "load_config",
    "load_train_config", "to_dict", "validate_train_config",
]
