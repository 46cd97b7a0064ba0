"""Two rollout engines, each killed with SIGKILL once in one run: one in the middle of the first weight sync (after
step 1), the other during step 2's rollout. The sync fails, the engine is restarted and the sync runs again into
every engine; the rollout completes on the surviving engine (the dead engine's groups run again there) and the dead
engine is restarted and synced before the next rollout. The run trains to the end with every engine passing the
probe check after every sync. (One engine dying during a sync, with no survivor beside it:
test_engine_dies_during_sync.py.)"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from rlsearch.weights.shm import SENDER_FILE_PREFIX, STAGING_DIR
from tests.conftest import REPO_ROOT
from tests.faults.processes import engine_processes, logged_pids
from tests.faults.test_killed_worker import _command

STEPS = 3  # the step the sync after which an engine dies, the step whose rollout loses one, and one more


def sender_files(run_dir: Path) -> set[Path]:
    """The bucket files of the weight senders of the run in `run_dir` (its actor ranks; shm transport): the first
    appears when a sync starts. Those of another test's senders (the other lane's) are not the run's."""
    prefix = f"{SENDER_FILE_PREFIX}{socket.gethostname()}-"
    ranks = {str(pid) for pid in logged_pids(run_dir, "actor-rank*")}
    return {path for path in Path(STAGING_DIR).glob(f"{prefix}*")
            if path.name.removeprefix(prefix).split("-", 1)[0] in ranks}


KillPoint = Callable[[], "list[int] | None"]


def first_sync_started(run_dir: Path) -> KillPoint:
    """A kill point: the first sync of the run in `run_dir` has started, its sender writing its first bucket file.
    The sender is held stopped while the engine is killed: a tiny model's sync can end before the kill lands."""
    before = sender_files(run_dir)
    prefix = f"{SENDER_FILE_PREFIX}{socket.gethostname()}-"

    def senders() -> list[int] | None:
        started = sender_files(run_dir) - before
        return sorted({int(path.name.removeprefix(prefix).split("-", 1)[0]) for path in started}) or None

    return senders


def printed(log_path: Path, text: str) -> KillPoint:
    """A kill point: the run printed `text`."""
    return lambda: [] if text in log_path.read_text() else None


def run_killing_engines(command: list[str], log_path: Path, env: dict, kills: list[KillPoint],
                        engines: Callable[[], dict[str, psutil.Process]] = engine_processes,
                        ) -> tuple[int, str, list[str]]:
    """Run `command` (a training run, with `env` on top of this process's environment), output to `log_path`; at
    each of `kills` in turn (None until it is reached, then the pids to hold stopped until the kill is done), kill one
    of its rollout engines with SIGKILL: the first of `engines()` (by default those on the test session's Ray, by Ray
    name) not killed before. Returns the run's exit status, its output and the killed engines' keys."""
    with log_path.open("w") as log:
        run = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
    killed: list[str] = []
    try:
        for kill_point in kills:
            deadline = time.monotonic() + 600
            while (held := kill_point()) is None:
                assert run.poll() is None and time.monotonic() < deadline, (
                    "the run ended, or reached no kill point in 600 s (a hang guard): " + log_path.read_text()[-3000:])
                time.sleep(0.01)
            for pid in held:
                os.kill(pid, signal.SIGSTOP)
            try:
                key, victim = next((key, process) for key, process in engines().items() if key not in killed)
                os.kill(victim.pid, signal.SIGKILL)
                victim.wait(timeout=60)
            finally:
                for pid in held:
                    os.kill(pid, signal.SIGCONT)
            killed.append(key)
        returncode = run.wait(timeout=900)
    finally:
        if run.poll() is None:
            run.kill()
    return returncode, log_path.read_text(), killed


def test_engines_killed_during_a_sync_and_during_a_rollout_are_replaced_and_the_run_goes_on(
    tmp_path, tiny_model_dir, toy_data, driver_ray
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, log_path = tmp_path / "run", tmp_path / "train.log"
    # a random model earns no reward; the k1 KL term changes the weights every step, so every step syncs
    command = _command(tiny_model_dir, toy_data, tmp_path / "bm25", run_dir, "rollout.num_engines=2",
                       "rollout.groups_per_engine=1", "data.batch_size=4", f"trainer.total_steps={STEPS}",
                       "trainer.save_interval=0", "weights.transport=shm", "algo.kl_coef=0.1", "algo.kl_estimator=k1")
    # the first sync comes after step 1's update; step 2's rollout starts right after step 1's line
    returncode, output, killed = run_killing_engines(command, log_path, driver_ray, [
        first_sync_started(run_dir), printed(log_path, f"step 1/{STEPS} |")])
    assert returncode == 0, output[-3000:]
    assert len(set(killed)) == 2
    for step in range(1, STEPS + 1):
        assert f"step {step}/{STEPS} | reward" in output
    assert "died; its groups ran on the others" in output
    assert output.count("restarted rollout engine") == 2, output[-3000:]
    # the driver's start-up, phase by phase (what a driver restart costs)
    assert re.search(r"\[rlsearch\] started in [\d.]+ s: tool servers [\d.]+, Ray [\d.]+, rollout engines [\d.]+ and "
                     r"actor ranks [\d.]+ side by side \([\d.]+\), the rest \(imports, data, checks\) [\d.]+$", output,
                     re.MULTILINE), output[:3000]

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    # step 2's rollout lost an engine: its groups ran again on the other; no other rollout did
    assert [e.value >= 1 for e in events.Scalars("rollout/redispatched_groups")] == [False, True, False]
    restarts = [e.value for e in events.Scalars("rollout/engine_restarts_total")]
    assert restarts[0] == 1.0 and restarts[-1] == 2.0 and restarts == sorted(restarts)
    assert [e.value for e in events.Scalars("weights/engines")] == [2.0] * STEPS  # every sync reached both
    # every group of the step after the last restart ran, on both engines again
    per_engine = [events.Scalars(f"rollout/engine{engine}/groups")[STEPS - 1].value for engine in (0, 1)]
    assert sum(per_engine) == 4 and min(per_engine) >= 1, per_engine
    # the probe check covers every engine after every sync, the restarted ones included
    assert max(e.value for e in events.Scalars("weights/logprob_mismatch_max")) < 1e-4
