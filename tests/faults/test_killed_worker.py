"""A Ray actor of a training run killed with SIGKILL (a Megatron rank; the rollout worker, once no engine restart is
allowed, rollout.max_engine_restarts_per_step=0): the trainer stops within a bounded time naming the dead component
and the last complete checkpoint, and `trainer.resume=auto` continues. (Engines restarted instead:
test_killed_engine.py, test_engine_dies_during_sync.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import REPO_ROOT

STOP_WITHIN_S = 90  # from the kill to the driver's exit, engine and Ray shutdown included


def _command(tiny_model_dir, toy_data, index_cache, output_dir, *extra):
    return [
        sys.executable, "-m", "rlsearch", "train", "--config", "examples/configs/search_grpo_tiny.yaml",
        f"model.path={tiny_model_dir}", f"data.train_files=[{toy_data.train}]",
        f"tools.retriever.corpus={toy_data.corpus}", f"tools.retriever.index_cache_dir={index_cache}",
        "data.batch_size=2", "trainer.total_steps=2", "trainer.save_interval=1", f"trainer.output_dir={output_dir}",
        *extra,
    ]


def _ray_actor_process(driver_pid: int, actor_class: str) -> psutil.Process:
    """The process of the run's actor of that class (Ray titles it ``ray::Class.method``), under this driver only."""
    for process in psutil.Process(driver_pid).children(recursive=True):
        try:
            title = " ".join(process.cmdline())
        except psutil.Error:
            continue
        if title.startswith(f"ray::{actor_class}"):
            return process
    raise AssertionError(f"no ray::{actor_class} process under the driver {driver_pid}")


@pytest.mark.parametrize(
    ("actor_class", "component", "extra"),
    [("RolloutWorker", "rollout engine 0", ["rollout.max_engine_restarts_per_step=0"]),
     ("MegatronActorWorker", "actor rank 0 (tp 0, pp 0, cp 0, dp 0)", [])],
    ids=["rollout-worker", "actor-rank"],
)
def test_a_killed_worker_stops_the_run_naming_it_and_resume_continues(
    tmp_path, tiny_model_dir, toy_data, actor_class, component, extra
):
    run_dir, log_path = tmp_path / "run", tmp_path / "train.log"
    command = _command(tiny_model_dir, toy_data, tmp_path / "bm25", run_dir, *extra)
    with log_path.open("w") as log:
        run = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while "checkpoints/step_000001" not in log_path.read_text():
            assert run.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.05)
        victim = _ray_actor_process(run.pid, actor_class)
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        returncode = run.wait(timeout=STOP_WITHIN_S)
        stopped_after_s = time.monotonic() - killed
    finally:
        if run.poll() is None:
            run.kill()
    output = log_path.read_text()
    assert returncode == 1, output[-3000:]
    assert stopped_after_s < STOP_WITHIN_S
    message = next(line for line in output.splitlines() if line.startswith("rlsearch train:"))
    assert f"{component} died (its process exited)" in message
    assert f"the last complete checkpoint is {run_dir / 'checkpoints' / 'step_000001'}" in message
    print(f"\n{component}: killed during step 2, the driver exited {stopped_after_s:.1f} s later")
    assert "Traceback" not in output.split("checkpoints/step_000001")[-1]
    assert not list((run_dir / "checkpoints").glob(".incomplete_*"))

    if actor_class == "MegatronActorWorker":
        resumed = subprocess.run(command + ["trainer.resume=auto"], cwd=REPO_ROOT, capture_output=True, text=True,
                                 timeout=900)
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
        assert f"resumed from {run_dir / 'checkpoints' / 'step_000001'}" in resumed.stdout
        assert "step 2/2 | reward" in resumed.stdout
