"""Where library output goes: by default every process's library logs (vLLM, Ray, Megatron, transformers, uvicorn,
warnings) go to files under the run's ``logs/`` dir, one per process, and the terminal keeps rlsearch's own lines and
errors. ``--verbose`` (or RLSEARCH_VERBOSE=1) leaves everything on the terminal, as the libraries print it.

The driver names the dir in RLSEARCH_LOG_DIR; Ray passes RLSEARCH_* variables to its workers, and each worker
process points its stdout and stderr into its own file there (`redirect_worker_output`), so the subprocesses it
starts (vLLM's engine core and tensor-parallel workers) write there too. The driver does the same with its file
descriptors 1 and 2 (what C++ code and the processes it starts write, e.g. an in-process vLLM engine's core) while
Python's sys.stdout and sys.stderr keep the terminal: rlsearch's lines, and errors in full (a worker's exception
travels to the driver with its traceback).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

LOG_DIR_ENV = "RLSEARCH_LOG_DIR"
VERBOSE_ENV = "RLSEARCH_VERBOSE"
LOGS_SUBDIR = "logs"
LIBRARY_LOGGERS = (
    "vllm", "ray", "megatron", "transformers", "torch", "uvicorn", "httpx", "httpcore", "urllib3", "mcp",
    "py.warnings", "datasets", "sentence_transformers", "bm25s", "filelock", "asyncio",
)


def _verbose_requested(flag: bool) -> bool:
    return flag or os.environ.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes")


def route_library_logs(output_dir: str | Path, verbose: bool = False) -> Path | None:
    """Send this process's library logs to ``output_dir/logs/driver.log`` and tell worker processes started from here
    (Ray actors, tool servers) to write theirs beside it. Returns the logs dir, or None when verbose (nothing moves)."""
    if _verbose_requested(verbose):
        os.environ.pop(LOG_DIR_ENV, None)
        return None
    log_dir = Path(output_dir) / LOGS_SUBDIR
    log_dir.mkdir(parents=True, exist_ok=True)
    os.environ[LOG_DIR_ENV] = str(log_dir.resolve())  # workers may start in another directory
    # vLLM otherwise gives its logger a handler of its own on stdout when it is imported in this process
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    _keep_only_python_on_the_terminal(log_dir / "driver.log")
    handler = logging.FileHandler(log_dir / "driver.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.captureWarnings(True)
    for name in LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        library.handlers = [handler]
        library.propagate = False
    return log_dir


def _keep_only_python_on_the_terminal(log_path: Path) -> None:
    """File descriptors 1 and 2 write to `log_path`; sys.stdout and sys.stderr to where they wrote before."""
    terminal = [os.dup(1), os.dup(2)]
    _point_output_descriptors_at(log_path)
    sys.stdout = os.fdopen(terminal[0], "w", buffering=1, encoding=sys.stdout.encoding, errors=sys.stdout.errors)
    sys.stderr = os.fdopen(terminal[1], "w", buffering=1, encoding=sys.stderr.encoding, errors=sys.stderr.errors)


def process_log_dir() -> Path | None:
    """The logs dir the driver set up, or None (verbose: library output stays on the terminal)."""
    value = os.environ.get(LOG_DIR_ENV, "")
    return Path(value) if value else None


def redirect_worker_output(role: str) -> Path | None:
    """In a Ray actor's process: point stdout and stderr, the file descriptors included, at ``logs/<role>-<pid>.log``.
    Child processes started afterwards inherit the file. None when verbose, or outside a Ray actor (the same class
    used in the driver's own process leaves the driver's terminal alone)."""
    log_dir = process_log_dir()
    if log_dir is None or not in_ray_actor():
        return None
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"{role}-{os.getpid()}.log"
    _point_output_descriptors_at(path)
    return path


def _point_output_descriptors_at(path: Path) -> None:
    """File descriptors 1 and 2 append to `path` (what Python buffered so far is written out first)."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def in_ray_actor() -> bool:
    """Whether this process is a Ray actor's (a process of its own), not a driver's or a script's."""
    if "ray" not in sys.modules:
        return False
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
