"""Where library output goes: the run's logs dir by default, the terminal with --verbose / RLSEARCH_VERBOSE."""

import os
import subprocess
import sys

from tests.conftest import REPO_ROOT

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
