"""The skips the suite allows: only tests marked gpu, on a machine without CUDA. Any other skip (a missing tool or
right, e.g. mount or unshare) fails the run."""

from __future__ import annotations

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    _skip_gpu_tests_without_cuda(items)


def _skip_gpu_tests_without_cuda(items) -> None:
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_tests:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: scripts/gpu_check.sh runs these on a GPU machine")
    for item in gpu_tests:
        item.add_marker(skip)


UNEXPECTED_SKIPS: list[str] = []


def pytest_runtest_logreport(report):
    """Records the skips of tests that do not need a GPU (in the run itself: the lanes' reports come to it)."""
    if report.skipped and "gpu" not in report.keywords:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        UNEXPECTED_SKIPS.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session):
    if UNEXPECTED_SKIPS and not hasattr(session.config, "workerinput") and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED  # a skip that hides a missing tool or right is a failure


def pytest_terminal_summary(terminalreporter):
    if UNEXPECTED_SKIPS:
        terminalreporter.write_line(f"{len(UNEXPECTED_SKIPS)} tests skipped that need no GPU, so the run fails (only "
                                    "tests marked gpu may skip): " + "; ".join(UNEXPECTED_SKIPS), red=True)
