"""Checkpoints: complete-or-absent run checkpoints (Megatron distributed format + trainer state), resume, and
conversion to and from HuggingFace (and from llama.cpp's GGUF)."""

from .convert import (  # imports megatron only in its ranks
    ConversionError,
    HFExport,
    hf_to_mcore,
    mcore_to_hf,
    write_hf_model,
)
from .gguf import GGUFConversion, GGUFError, gguf_to_hf  # imports gguf and transformers only when it converts
from .layout import CheckpointError, read_manifest
from .store import CheckpointStore, load_run_checkpoint

__all__ = [
    "CheckpointError", "CheckpointStore", "ConversionError", "GGUFConversion", "GGUFError", "HFExport",
    "gguf_to_hf", "hf_to_mcore", "load_run_checkpoint", "mcore_to_hf", "read_manifest", "write_hf_model",
]
