"""Checkpoints: complete-or-absent run checkpoints (Megatron distributed format + trainer state), resume, and
conversion to and from HuggingFace."""

from .convert import (  # imports megatron only in its ranks
    ConversionError,
    HFExport,
    hf_to_mcore,
    mcore_to_hf,
    write_hf_model,
)
from .layout import CheckpointError, read_manifest
from .store import CheckpointStore, load_run_checkpoint

__all__ = [
    "CheckpointError", "CheckpointStore", "ConversionError", "HFExport", "hf_to_mcore", "load_run_checkpoint",
    "mcore_to_hf", "read_manifest", "write_hf_model",
]
