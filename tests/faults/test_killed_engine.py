"""One of two rollout engines killed with SIGKILL during a rollout: the step completes on the surviving engine (the
dead engine's groups run again there), the dead engine is restarted and re-synced before the next rollout, and the
run trains to the end with every engine passing the probe check."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.conftest import REPO_ROOT
from tests.faults.test_killed_worker import _ray_actor_process

STEPS = 2  # the killed engine's step, and one after its restart


def run_killing_an_engine(command: list[str], log_path: Path, ready: Callable[[], bool]) -> tuple[int, str]:
    """Run `command` (a training run), output to `log_path`; once `ready()`, kill one of its rollout workers with
    SIGKILL. Returns the run's exit status and output."""
    with log_path.open("w") as log:
        run = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not ready():
            assert run.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.01)
        os.kill(_ray_actor_process(run.pid, "RolloutWorker").pid, signal.SIGKILL)
        returncode = run.wait(timeout=900)
    finally:
        if run.poll() is None:
            run.kill()
    return returncode, log_path.read_text()


def test_a_killed_engine_is_replaced_and_the_run_goes_on(tmp_path, tiny_model_dir, toy_data):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, log_path = tmp_path / "run", tmp_path / "train.log"
    command = [
        sys.executable, "-m", "rlsearch", "train", "--config", "examples/configs/search_grpo_tiny.yaml",
        f"model.path={tiny_model_dir}", f"data.train_files=[{toy_data.train}]",
        f"tools.retriever.corpus={toy_data.corpus}", f"tools.retriever.index_cache_dir={tmp_path / 'bm25'}",
        "rollout.num_engines=2", "rollout.groups_per_engine=1", "data.batch_size=4", f"trainer.total_steps={STEPS}",
        f"trainer.output_dir={run_dir}",
    ]
    # the first rollout starts right after the "logprobs before training" line
    returncode, output = run_killing_an_engine(command, log_path, lambda: "logprobs before training" in
                                               log_path.read_text())
    assert returncode == 0, output[-3000:]
    for step in range(1, STEPS + 1):
        assert f"step {step}/{STEPS} | reward" in output
    assert "died; its groups ran on the others" in output
    # the driver's start-up, phase by phase (what a driver restart costs)
    assert re.search(r"\[rlsearch\] started in [\d.]+ s: tool servers [\d.]+, Ray [\d.]+, rollout engines [\d.]+ and "
                     r"actor ranks [\d.]+ side by side \([\d.]+\), the rest \(imports, data, checks\) [\d.]+$", output,
                     re.MULTILINE), output[:3000]
    assert "restarted rollout engine" in output

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    redispatched = [e.value for e in events.Scalars("rollout/redispatched_groups")]
    assert redispatched[0] >= 1 and redispatched[1:] == [0.0] * (STEPS - 1)
    assert [e.value for e in events.Scalars("rollout/engine_restarts_total")] == [1.0] * STEPS
    # every group of the step after the restart ran, on both engines again
    for step_index in range(1, STEPS):
        per_engine = [events.Scalars(f"rollout/engine{engine}/groups")[step_index].value for engine in (0, 1)]
        assert sum(per_engine) == 4 and min(per_engine) >= 1, per_engine
    # the probe check covers every engine after every sync, the restarted one included
    assert max(e.value for e in events.Scalars("weights/logprob_mismatch_max")) < 1e-4
