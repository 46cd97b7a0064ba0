"""What the GPU tier's tests share. The tier (tests/gpu) checks what only a CUDA machine can, each test marked `gpu`
(skipped without CUDA: tests/conftest.py) and printing its figures; `bash scripts/gpu_check.sh` runs it.
RLSEARCH_GPU_SHAPE picks the random model the benches build (bench/common SHAPES: tiny, the default, or 0.5b for
figures worth recording)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.constants import REPO_ROOT

BENCH_SHAPE = os.environ.get("RLSEARCH_GPU_SHAPE", "tiny")


def run_bench(script: str, *args: str, timeout: int = 1800) -> str:
    """bench/`script` with `args` (its random model cached under outputs/bench); its output, printed with a [gpu]
    prefix. Fails with the output's end when it exits non-zero."""
    result = subprocess.run([sys.executable, f"bench/{script}", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    for line in result.stdout.splitlines():
        print(f"[gpu] {script}: {line}", flush=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def require_two_gpus() -> None:
    """rlsearch puts the actor ranks and the engines on disjoint GPUs, and NCCL refuses two ranks on one GPU: a run
    through Ray, or a broadcast over nccl, needs two. Skips the calling test on a machine with fewer."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs (an actor rank and an engine, each on its own); this machine has "
                    f"{torch.cuda.device_count()}")
