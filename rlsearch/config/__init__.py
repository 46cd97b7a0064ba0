"""Structured configs: dataclass schemas, YAML + dotted overrides, validation with errors naming the key."""

from .auto import auto_dtype, resolve_auto_keys, resolve_store_dirs, store_dir
from .defaults import EngineSpec, default_encoder_path
from .loader import ConfigError, from_dict, load_config, to_dict
from .model_checks import (
    check_actor_devices,
    check_model_dir,
    check_model_files,
    check_model_layout,
    check_same_tokenizer,
    check_train_model_files,
    dropout_turned_off,
    read_hf_config,
)
from .schema import (
    TRUNCATION_REASONS,
    ActorConfig,
    AlgoConfig,
    BrowseConfig,
    CriticConfig,
    CriticModelConfig,
    DataConfig,
    EndpointConfig,
    EvalConfig,
    EvalSettings,
    EvolveConfig,
    JinaConfig,
    JudgeConfig,
    MCPConfig,
    MCPServerConfig,
    ModelConfig,
    RetrieverConfig,
    RewardConfig,
    RolloutConfig,
    RubricConfig,
    SerperConfig,
    SFTConfig,
    SFTDataConfig,
    SummariserConfig,
    ToolsConfig,
    TrainConfig,
    TrainerConfig,
    WeightsConfig,
)
from .validate import validate_eval_config, validate_sft_config, validate_train_config


def load_train_config(path: str | None, overrides: list[str] | None = None) -> TrainConfig:
    return validate_train_config(load_config(TrainConfig, path, overrides))


def load_sft_config(path: str | None, overrides: list[str] | None = None) -> SFTConfig:
    return validate_sft_config(load_config(SFTConfig, path, overrides))


def load_eval_config(path: str | None, overrides: list[str] | None = None) -> EvalConfig:
    return validate_eval_config(load_config(EvalConfig, path, overrides))


__all__ = [
    "ActorConfig", "AlgoConfig", "WeightsConfig", "BrowseConfig", "ConfigError", "CriticConfig", "CriticModelConfig",
    "DataConfig", "EndpointConfig", "EvolveConfig",
    "EvalConfig", "EvalSettings", "JinaConfig", "JudgeConfig", "MCPConfig", "MCPServerConfig", "ModelConfig",
    "RetrieverConfig", "RewardConfig", "RolloutConfig", "RubricConfig", "SerperConfig", "SFTConfig", "SFTDataConfig",
    "SummariserConfig", "ToolsConfig", "TrainConfig", "TrainerConfig", "TRUNCATION_REASONS", "EngineSpec",
    "default_encoder_path",
    "auto_dtype", "from_dict", "load_config", "load_eval_config", "load_sft_config", "load_train_config",
    "resolve_auto_keys", "resolve_store_dirs", "store_dir", "to_dict",
    "check_actor_devices", "check_model_dir", "check_model_files", "check_model_layout", "check_same_tokenizer",
    "check_train_model_files", "dropout_turned_off", "read_hf_config",
    "validate_eval_config", "validate_sft_config",
    "validate_train_config",
]
