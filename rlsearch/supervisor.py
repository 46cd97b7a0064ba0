"""`rlsearch train --restarts N`: the training driver as a child process, run again when it dies.

A driver that dies (killed, out of memory, a worker failure it cannot survive) is run again with
`trainer.resume=auto`, so it continues from the run's newest complete checkpoint; each restart is printed and
appended to OUTPUT_DIR/logs/restarts.log. What a restart cannot fix is not retried: bad input (exit status 2) and a
stop asked for by the user (Ctrl-C, SIGTERM to the supervisor, which it passes on to the driver).

Unless the run joins a Ray cluster (trainer.ray_address), the supervisor starts the local Ray instance itself and
its drivers join it: the instance outlives a driver that dies, and so do the rollout engines (detached actors), which
the restarted driver takes over instead of starting new ones (`EnginePool`, ``detached``). A restart then costs the
actor ranks' start, the checkpoint's load and one weight sync.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .ray_setup import SUPERVISOR_RAY_VARIABLE, init_ray

ATTEMPT_VARIABLE = "RLSEARCH_DRIVER_ATTEMPT"  # set in the driver's environment: 0 for the first run, then 1, 2, ...
BAD_INPUT = 2
NOT_RETRIED = {0, BAD_INPUT, 128 + signal.SIGINT, -signal.SIGINT}


def supervised() -> bool:
    """Whether this process is a driver run by the supervisor."""
    return ATTEMPT_VARIABLE in os.environ


def restarted() -> bool:
    """Whether this process is a driver the supervisor runs again after one died: its output dir holds its own run."""
    return os.environ.get(ATTEMPT_VARIABLE, "0") != "0"


def _describe(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


def supervise_train(config_path: str | None, overrides: list[str], verbose: bool, restarts: int,
                    output_dir: str, ray_cpus: int = 0) -> int:
    """Run `rlsearch train` with these arguments, and up to `restarts` more times with trainer.resume=auto while it
    dies; returns the last run's exit status (1 for a driver killed by a signal). `ray_cpus` > 0: the drivers join a
    local Ray instance of that many CPUs that this process starts and stops (0: they start or join Ray themselves)."""
    command = [sys.executable, "-m", "rlsearch", "train", *(["--config", config_path] if config_path else []),
               *(["--verbose"] if verbose else []), *overrides]
    log = Path(output_dir) / "logs" / "restarts.log"
    stopping = False

    def stop(signum, _frame) -> None:  # pass a stop on to the driver, and do not restart it
        nonlocal stopping
        stopping = True
        if child.poll() is None:
            child.send_signal(signum)

    ray_address = _start_ray(ray_cpus) if ray_cpus else ""
    environment = {**os.environ, **({SUPERVISOR_RAY_VARIABLE: ray_address} if ray_address else {})}
    previous = signal.signal(signal.SIGTERM, stop)
    attempt = 0
    try:
        while True:
            # resumed from the run's newest checkpoint; before the first one, the driver starts as it first did
            resume = ["trainer.resume=auto"] if attempt and _has_checkpoint(output_dir) else []
            child = subprocess.Popen(command + resume, env={**environment, ATTEMPT_VARIABLE: str(attempt)})
            try:
                returncode = child.wait()
            except KeyboardInterrupt:  # Ctrl-C reached the driver too (one process group): let it stop
                return child.wait()
            if returncode in NOT_RETRIED or stopping:
                return returncode
            if attempt == restarts:
                print(f"[rlsearch] the training driver died ({_describe(returncode)}) after {restarts} restart(s) "
                      "(--restarts): giving up", file=sys.stderr, flush=True)
                return returncode if returncode > 0 else 1
            attempt += 1
            line = (f"the training driver died ({_describe(returncode)}); restart {attempt} of {restarts} with "
                    "trainer.resume=auto")
            print(f"[rlsearch] {line}", flush=True)
            log.parent.mkdir(parents=True, exist_ok=True)
            with log.open("a") as restarts_log:
                restarts_log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
    finally:
        signal.signal(signal.SIGTERM, previous)
        if ray_cpus:
            import ray

            ray.shutdown()


def _start_ray(num_cpus: int) -> str:
    """A local Ray instance for the drivers (the settings a driver's own would have); returns its address."""
    import ray

    init_ray(num_cpus=num_cpus)
    return ray.get_runtime_context().gcs_address


def _has_checkpoint(output_dir: str) -> bool:
    from .checkpoint import CheckpointStore

    return CheckpointStore(output_dir).newest_complete()[0] is not None
