"""Where library output goes: the run's logs dir by default, the terminal with --verbose / RLSEARCH_VERBOSE."""

import os
import subprocess
import sys

from tests.constants import REPO_ROOT

ROUTE_AND_LOG = """
import logging, os, subprocess, sys, warnings
from rlsearch.runlog import redirect_worker_output, route_library_logs
log_dir = route_library_logs(sys.argv[1], verbose=sys.argv[2] == "verbose")
print("log dir", log_dir)
logging.getLogger("vllm.engine").warning("an engine warning")
warnings.warn("a library deprecation")
os.write(2, b"a C library's line\\n")
subprocess.run(["echo", "an engine core's line"])
print("ours", redirect_worker_output("rollout-engine"))  # not a Ray actor: the driver's terminal stays
print("an error of ours", file=sys.stderr)
"""


def _route(tmp_path, mode, **env):
    return subprocess.run(
        [sys.executable, "-W", "default", "-c", ROUTE_AND_LOG, str(tmp_path / "run"), mode], cwd=REPO_ROOT,
        capture_output=True, text=True, timeout=60,
        env={**{k: v for k, v in os.environ.items() if k != "RLSEARCH_VERBOSE"}, **env},
    )


def test_library_logs_go_to_the_run_logs_dir_and_ours_stay(tmp_path):
    result = _route(tmp_path, "quiet")
    assert result.returncode == 0, result.stderr
    log_dir = tmp_path / "run" / "logs"
    assert result.stdout.splitlines() == [f"log dir {log_dir}", "ours None"]
    assert result.stderr == "an error of ours\n"
    driver_log = (log_dir / "driver.log").read_text()
    for line in ("WARNING vllm.engine: an engine warning", "a library deprecation", "a C library's line",
                 "an engine core's line"):
        assert line in driver_log


def test_verbose_leaves_library_logs_on_the_terminal(tmp_path):
    for mode, env in (("verbose", {}), ("quiet", {"RLSEARCH_VERBOSE": "1"})):
        result = _route(tmp_path, mode, **env)
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines()[0] == "log dir None"
        assert "an engine warning" in result.stderr and "a library deprecation" in result.stderr
        assert "a C library's line" in result.stderr and "an engine core's line" in result.stdout
        assert not (tmp_path / "run" / "logs").exists()


def test_a_worker_outside_ray_keeps_its_output(tmp_path, monkeypatch):
    from rlsearch.runlog import redirect_worker_output

    monkeypatch.setenv("RLSEARCH_LOG_DIR", str(tmp_path))
    assert redirect_worker_output("actor-rank0") is None
    assert list(tmp_path.iterdir()) == []


class _RayTaskError(Exception):
    """What Ray raises in the driver for a task that raised in another process: its pid and the exception."""

    def __init__(self, message: str, pid: int, cause: BaseException) -> None:
        super().__init__(message)
        self.pid, self.cause = pid, cause


class EngineDeadError(Exception):
    pass


ENGINE_LOG = """Loading safetensors checkpoint shards: 100% Completed
EngineCore encountered a fatal error.
Traceback (most recent call last):
  File "core.py", line 1496, in run_engine_core
    raise RuntimeError("in a frame")
RuntimeError: Unsupported CPU attention configuration: head_dim=16
AsyncLLM output_handler failed.
vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.
Process EngineCore:
RuntimeError: Unsupported CPU attention configuration: head_dim=16
ray.exceptions.RayTaskError(EngineDeadError): ray::RolloutWorker.sample_probe() (pid=4242, ip=127.0.0.1)
ValueError: a second error of its own
"""


def test_a_process_failure_is_reported_by_the_processs_own_error_lines(tmp_path):
    """The root cause first, each line once, no line that only reports another failure (vLLM's EngineDeadError, Ray's
    wrappers); the exception the process raised itself comes first; no pid: not another process's failure."""
    from rlsearch.runlog import process_failure

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rollout-engine-4242.log").write_text(ENGINE_LOG)
    (logs / "actor-rank1-4343.log").write_text("a line\n")
    dead = _RayTaskError("ray::RolloutWorker.sample_probe() (pid=4242)", 4242, EngineDeadError("see above"))
    assert process_failure(RuntimeError("the probe failed"), logs) is None
    wrapped = RuntimeError("the probe failed")
    wrapped.__cause__ = dead
    failure = process_failure(wrapped, logs)
    assert failure.process == "the rollout engine in process 4242"
    assert failure.errors == ("RuntimeError: Unsupported CPU attention configuration: head_dim=16",
                              "ValueError: a second error of its own")
    assert failure.render("train").splitlines() == [
        "rlsearch train: the rollout engine in process 4242 failed: RuntimeError: Unsupported CPU attention "
        "configuration: head_dim=16",
        "  then: ValueError: a second error of its own",
        f"  its log (the rest of what it wrote): {logs / 'rollout-engine-4242.log'}",
    ]
    raised = process_failure(_RayTaskError("(pid=4343)", 4343, RuntimeError("no Transformer Engine\nmore")), logs)
    assert raised.process == "the actor rank 1 in process 4343"
    assert raised.errors == ("RuntimeError: no Transformer Engine",)
    # a process whose log is not in the logs dir (another run's) is still named, by its pid
    assert process_failure(_RayTaskError("(pid=99)", 99, EngineDeadError("x")), logs).process == "the process 99"


class ActorDiedError(Exception):
    pass


class OutOfMemoryError(Exception):
    pass


# Ray 2.60's message for an actor whose process was killed with SIGKILL during a call
KILLED_ACTOR = (
    "The actor died unexpectedly before finishing this task.\n\tclass_name: MegatronActorWorker\n\tactor_id: 13d4fd64"
    "\n\tpid: 3823\n\tnamespace: rlsearch\n\tip: 127.0.0.1\nThe actor is dead because its worker process has died. "
    "Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error code 2. End "
    "of file. Some common causes include: (1) the process was killed by the OOM killer due to high memory usage, (2) "
    "ray stop --force was called, or (3) the worker crashed unexpectedly due to SIGSEGV or another unexpected error. "
    "If the process was killed by the kernel OOM killer (verifiable by checking for OOM in dmesg of the OOMing node), "
    "consider enabling resource isolation via --enable-resource-isolation to prevent node deaths by resource "
    "contention and significant loss of progress by uninformed kernel OOM killing.")


def test_a_process_that_died_without_an_error_line_is_reported_with_rays_account_of_its_death(tmp_path):
    """A rank killed by a signal or for memory writes nothing: the terminal says how Ray saw it die, the exit type and
    the detail's first sentences, instead of only pointing at the log."""
    from rlsearch.runlog import process_failure

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "actor-rank0-3823.log").write_text("step 3 done\n")
    killed = process_failure(ActorDiedError(KILLED_ACTOR), logs)
    assert killed.process == "the actor rank 0 in process 3823"
    assert killed.errors == ()
    assert killed.death == (
        "SYSTEM_ERROR: Worker unexpectedly exits with a connection error code 2. End of file. Some common causes "
        "include: (1) the process was killed by the OOM killer due to high memory usage, (2) ray stop --force was "
        "called, or (3) the worker crashed unexpectedly due to SIGSEGV or another unexpected error.")
    assert killed.render("train").splitlines()[0] == (
        f"rlsearch train: the actor rank 0 in process 3823 failed: it died without an error line of its own; Ray: "
        f"{killed.death}")
    evicted = OutOfMemoryError(
        "Task was killed due to the node running low on memory.\nMemory on the node (IP: 127.0.0.1, ID: c018) where "
        "the task (actor ID: 13d4, pid=3823, memory used=0.5GB) was running was 22.95GB / 24.14GB (0.950), which "
        "exceeds the memory usage threshold of 0.95.")
    failure = process_failure(evicted, logs)
    assert failure.process == "the actor rank 0 in process 3823"
    assert failure.death.startswith("OUT_OF_MEMORY: Task was killed due to the node running low on memory. Memory on")
    assert failure.death.endswith("(0.950), which exceeds the memory usage threshold of 0.95.")
    raised = _RayTaskError("(pid=3823)", 3823, RuntimeError("its own"))  # a process that raised: its own line only
    assert process_failure(raised, logs).render("train").splitlines()[0].endswith("failed: RuntimeError: its own")


def test_the_exception_the_process_raised_comes_first_then_its_logs_lines(tmp_path):
    """A log whose end already holds more error lines than are shown must not push out the exception the process
    raised itself: that one is its root cause as Ray saw it."""
    from rlsearch.runlog import process_failure

    logs = tmp_path / "logs"
    logs.mkdir()
    warnings = "".join(f"ValueError: a retried request {i}\n" for i in range(4))
    (logs / "actor-rank0-4545.log").write_text(warnings)
    failure = process_failure(_RayTaskError("(pid=4545)", 4545, MemoryError("CUDA out of memory")), logs)
    assert failure.errors == ("MemoryError: CUDA out of memory", "ValueError: a retried request 0",
                              "ValueError: a retried request 1")


DRIVER_FAILS = """
import sys
from types import SimpleNamespace
from rlsearch.cli import _run_summarised

class _RayTaskError(Exception):
    def __init__(self, message, pid, cause):
        super().__init__(message)
        self.pid, self.cause = pid, cause

def run(config):
    if sys.argv[2] == "names a pid":
        raise KeyError("the retriever (pid=4242) answered without 'result'")
    if sys.argv[2] == "while handling":
        try:
            raise _RayTaskError("(pid=4646)", 4646, RuntimeError("rank 0 ran out of memory"))
        except _RayTaskError:
            {}["driver bug"]
    raise RuntimeError("the step failed") from _RayTaskError("(pid=4646)", 4646, RuntimeError("rank 0 ran out"))

args = SimpleNamespace(config="", overrides=[], verbose=False)
sys.exit(_run_summarised("train", lambda *_: None, run, lambda _: sys.argv[1], args))
"""


def _driver_failing(tmp_path, how: str) -> subprocess.CompletedProcess:
    (tmp_path / "logs").mkdir(exist_ok=True)
    (tmp_path / "logs" / "actor-rank0-4646.log").write_text("RuntimeError: rank 0 ran out of memory\n")
    return subprocess.run([sys.executable, "-c", DRIVER_FAILS, str(tmp_path), how], cwd=REPO_ROOT, text=True,
                          capture_output=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != "RLSEARCH_VERBOSE"})


def test_the_driver_traceback_is_dropped_only_when_the_process_failure_explains_it(tmp_path):
    """A driver error that only names a pid, or one raised while handling a process's failure (a bug of the
    driver's own), keeps its traceback; a driver error raised from the process's failure shows that process's own
    error instead."""
    named = _driver_failing(tmp_path, "names a pid")
    assert "Traceback" in named.stderr and "KeyError: \"the retriever (pid=4242) answered without 'result'\"" in (
        named.stderr), named.stderr
    handling = _driver_failing(tmp_path, "while handling")
    assert handling.stderr.startswith("rlsearch train: the actor rank 0 in process 4646 failed: RuntimeError: rank 0 "
                                      "ran out of memory\n"), handling.stderr
    assert "Traceback" in handling.stderr and "KeyError: 'driver bug'" in handling.stderr
    explained = _driver_failing(tmp_path, "raised from")
    assert explained.returncode == 1 and "Traceback" not in explained.stderr
    assert explained.stderr.splitlines()[0] == ("rlsearch train: the actor rank 0 in process 4646 failed: "
                                                "RuntimeError: rank 0 ran out")


def test_a_task_error_ray_made_of_the_processs_own_names_its_process():
    """Ray raises a task's failure in the driver as a class it makes of RayTaskError and the process's own exception
    ("RayTaskError(RuntimeError)"), whose only record of the process is its message's "(pid=..., ip=...)"."""
    from ray.exceptions import RayTaskError

    from rlsearch.runlog import process_failure

    failed = RayTaskError("initialize", "Traceback (most recent call last):\nRuntimeError: no Transformer Engine",
                          RuntimeError("no Transformer Engine"), proctitle="ray::MegatronActorWorker.initialize",
                          pid=4747, ip="127.0.0.1").as_instanceof_cause()
    assert type(failed).__name__ == "RayTaskError(RuntimeError)"
    failure = process_failure(failed, None)
    assert failure is not None and failure.process == "the process 4747"
    assert failure.errors == ("RuntimeError: no Transformer Engine",) and failure.explains_driver_error
