"""Checks of converted checkpoints that the conversion tests share: a converted dir's tensors, bit-exactness, the
CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from rlsearch.checkpoint.convert import SAFETENSORS_INDEX


def converted_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a converted dir, checking that the index lists exactly the tensors of its shards."""
    weight_map = json.loads((hf_dir / SAFETENSORS_INDEX).read_text())["weight_map"]
    tensors = {}
    for filename in sorted(set(weight_map.values())):
        shard = load_file(str(hf_dir / filename))
        assert {name for name, file in weight_map.items() if file == filename} == set(shard)
        tensors.update(shard)
    return tensors


def assert_bit_exact(converted: dict[str, torch.Tensor], original: dict[str, torch.Tensor]) -> None:
    assert set(converted) == set(original)
    for name, tensor in original.items():
        assert converted[name].dtype == tensor.dtype, name
        assert torch.equal(converted[name], tensor), name


def convert_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlsearch", "convert", *args], capture_output=True, text=True,
                          timeout=300)
