"""Checkpoints: complete-or-absent run checkpoints (Megatron distributed format + trainer state)."""

from .store import CheckpointStore

__all__ = ["CheckpointStore"]
