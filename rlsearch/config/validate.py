"""Cross-field checks that a dataclass type alone cannot express. Each error names the key."""

from __future__ import annotations

from .loader import ConfigError
from .schema import TrainConfig

_CHOICES = {
    "model.dtype": ("float32", "bfloat16"),
    "actor.backend": ("auto", "gloo", "nccl"),
    "actor.transformer_impl": ("auto", "local", "transformer_engine"),
    "actor.lr_decay_style": ("constant", "linear", "cosine"),
    "algo.kl_estimator": ("k1", "k2", "k3"),
    "algo.loss_agg": ("token_mean", "seq_mean_token_mean"),
    "rollout.protocol": ("search_r1",),
}

_POSITIVE = (
    "data.batch_size", "actor.tp", "actor.pp", "actor.dp", "actor.micro_batch_size", "rollout.group_size",
    "rollout.max_turns", "rollout.max_prompt_tokens", "rollout.max_response_tokens",
    "rollout.max_tokens_per_turn", "tools.retriever.topk", "trainer.total_steps", "bridge.bucket_mb",
)


def validate_train_config(config: TrainConfig) -> TrainConfig:
    for key, choices in _CHOICES.items():
        value = _get(config, key)
        if value not in choices:
            raise ConfigError(f"'{key}' must be one of {', '.join(choices)}; got {value!r}")
    for key in _POSITIVE:
        if _get(config, key) <= 0:
            raise ConfigError(f"'{key}' must be > 0; got {_get(config, key)!r}")
    if config.rollout.group_size < 2:
        raise ConfigError("'rollout.group_size' must be >= 2: GRPO normalises rewards within a group")
    if not config.data.train_files:
        raise ConfigError("'data.train_files' is empty: give at least one JSONL or parquet file")
    if config.trainer.save_interval < 0:
        raise ConfigError("'trainer.save_interval' must be >= 0")
    return config


def _get(config: object, dotted: str) -> object:
    node = config
    for part in dotted.split("."):
        node = getattr(node, part)
    return node
