"""Checkpoints: complete-or-absent run checkpoints (Megatron distributed format + trainer state), resume, and
conversion to and from HuggingFace."""

from .layout import CheckpointError, read_manifest
from .store import CheckpointStore, load_run_checkpoint

__all__ = ["CheckpointError", "CheckpointStore", "load_run_checkpoint", "read_manifest"]
