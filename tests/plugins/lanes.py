"""The lanes: `bash scripts/test.sh` runs the suite in two side by side (pytest-xdist: -n 2 --dist loadgroup), each a
worker process with session fixtures of its own. Which group each test goes in, the order the lanes take the groups,
the hang guards of the longest fixtures, and each lane's busy seconds by group after the run."""

from __future__ import annotations

import pytest

from tests.plugins.shared_engines import SHARED_ENGINES, SharedEngines

# A lane takes a group of tests at a time, the next one when it is almost done: first the two long groups (the
# training drivers run as subprocesses on the lane's Ray, driver_ray, taking its engines over; the tests of the engines
# and ranks shared in-process, SharedEngines), then every other module, and every bench's smoke run, on its own, the
# longest first. A training run alone keeps about 1.3 of 2 cores busy. (The memory-heavy modules and tests as one
# group of their own ran beside the drivers' heaviest runs and made the suite slower, not faster; the lanes' waits for
# the memory lock are printed after the run.)
DRIVER_TESTS = ("tests/e2e/", "tests/faults/", "tests/integration/test_multinode.py")
BENCH_SMOKE = "tests/integration/test_bench_smoke.py"
LONG_BENCH_SMOKES = ("chaos", "learning", "long_sequences", "soak")  # 1-4 minutes each; the others <1


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (tests/gpu, run by scripts/gpu_check.sh); skipped "
                            "without one")
    config.addinivalue_line("markers", "memory_heavy: holds several GiB of engines and ranks at once (a module's "
                            "pytestmark, or a test's): never beside another such module or test in the other lane")
    if not config.pluginmanager.hasplugin("xdist"):  # RLSEARCH_TEST_LANES=1: the lanes' marks are left unread
        config.addinivalue_line("markers", "xdist_group(name): the lane a test runs in (pytest-xdist)")


def pytest_itemcollected(item):
    """Each test's lane group, as it is collected: pytest-xdist reads the groups into the tests' ids in its own
    pytest_collection_modifyitems, before ours."""
    item.add_marker(pytest.mark.xdist_group(_lane_group(item)[1]))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: RLSEARCH_TEST_LANES=1 runs without it
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's loadgroup scheduling with the groups taken in the order of the tests (the longest first, as
    pytest_collection_modifyitems puts them), where xdist takes the groups with the most tests first."""
    from xdist.scheduler import LoadGroupScheduling

    class InTestOrder(LoadGroupScheduling):
        def _assign_work_unit(self, node) -> None:
            if not getattr(self, "_in_test_order", False):  # the queue is complete on the first assignment
                first_test = {scope: index for index, scope in enumerate(dict.fromkeys(
                    self._split_scope(nodeid) for nodeid in self.collection))}
                for scope in sorted(self.workqueue, key=first_test.__getitem__):
                    self.workqueue.move_to_end(scope)
                self._in_test_order = True
            super()._assign_work_unit(node)

    return InTestOrder(config, log) if config.getvalue("dist") == "loadgroup" else None


# The hang guard of a test that uses these fixtures (pytest-timeout; scripts/test.sh sets the default, TEST_TIMEOUT_S):
# the README's default run (SFT and 30 steps of the real-vocabulary model) took 968 s on the slowest CPU seen
LONG_FIXTURE_TIMEOUT_S = {"default_run": 2400}


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: the run order below is the final one
def pytest_collection_modifyitems(config, items):
    for item in items:
        for fixture, seconds in LONG_FIXTURE_TIMEOUT_S.items():
            if fixture in item.fixturenames and not item.get_closest_marker("timeout"):
                item.add_marker(pytest.mark.timeout(seconds))
    items[:] = sorted(SHARED_ENGINES.group_users(items), key=lambda item: _lane_group(item)[0])  # stable sort


def _lane_group(item) -> tuple[int, str]:
    """The group a lane takes `item` in, and the rank of its kind in the order the lanes take groups."""
    module = item.nodeid.split("::")[0]
    if set(SHARED_ENGINES.uses(item)) - set(SharedEngines.UNGROUPED):  # wherever it is: started once, in one lane
        return 1, "shared-engines"
    if item.nodeid.startswith(DRIVER_TESTS):
        return 0, "drivers"
    if module == BENCH_SMOKE:
        long = any(f"[{name}.py]" in item.nodeid for name in LONG_BENCH_SMOKES)
        return (2 if long else 4), "bench-" + item.nodeid.split("[")[-1].split("]")[0]
    return (3 if module.startswith("tests/integration/") else 5), module



LANE_SECONDS: dict[str, dict[str, float]] = {}  # lane -> group -> seconds of its tests' set-up, call and teardown


def pytest_runtest_logreport(report):
    """Each lane's seconds by group (in the run itself: the lanes' reports come to it)."""
    lane = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", None)
    if lane is not None:
        group = report.nodeid.rsplit("@", 1)[-1] if "@" in report.nodeid else "-"
        LANE_SECONDS.setdefault(lane, {}).setdefault(group, 0.0)
        LANE_SECONDS[lane][group] += report.duration


def _lanes_line() -> str:
    """Each lane's busy seconds and its longest groups: the suite's wall time is about the busiest lane's."""
    lanes = []
    for lane, groups in sorted(LANE_SECONDS.items()):
        longest = sorted(groups.items(), key=lambda item: -item[1])[:3]
        lanes.append(f"{lane} {sum(groups.values()):.0f} s ("
                     + ", ".join(f"{group} {seconds:.0f}" for group, seconds in longest) + ")")
    return "lanes: " + "; ".join(lanes) if lanes else ""



def pytest_terminal_summary(terminalreporter):
    line = _lanes_line()
    if line:
        terminalreporter.write_line(line)
