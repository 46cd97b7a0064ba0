"""The README shows what the default run prints today: its lines equal the suite's default run's (conftest's
`default_run`, the README's command), every figure but the times (and the node's id, address and the run's paths)."""

from __future__ import annotations

import re

from tests.conftest import REPO_ROOT

COMMAND = "$ bash examples/run_search_grpo.sh"
# what differs between two runs of the same results: seconds, the Ray node, the run's own paths
TIMES = (
    (re.compile(r"\btime [\d.]+s\b"), "time *s"),
    (re.compile(r"\bin [\d.]+ s\b"), "in * s"),
    (re.compile(r"^\[rlsearch\] started in .*$"), "[rlsearch] started in *"),
    (re.compile(r"\bnode [0-9a-f]{8} \([\d.]+\)"), "node * (*)"),
)


def readme_run_lines() -> list[str]:
    """The lines of the README's default-run block, after its command line."""
    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    start = lines.index(COMMAND) + 1
    return lines[start:lines.index("```", start)]


def comparable(lines: list[str], paths: dict[str, str]) -> list[str]:
    """`lines` with the times and node masked and the run's paths (`paths`: as run -> as the README shows them) put
    back to the README's."""
    out = []
    for line in lines:
        for path, shown in paths.items():
            line = line.replace(path, shown)
        for pattern, mask in TIMES:
            line = pattern.sub(mask, line)
        out.append(line.rstrip())
    return out


def test_the_readme_shows_the_lines_the_default_run_prints(default_run):
    out, result = default_run
    printed = (result.stdout + result.stderr).splitlines()
    # a fresh clone's first run also installs and builds the assets first: the README shows a run after that
    printed = [line for line in printed if not line.startswith(("[setup]", "[rlsearch] building"))]
    paths = {str(out.parent / "sft-tiny"): "outputs/assets/sft-tiny", str(out): "outputs/search_grpo_tiny"}
    assert comparable(printed, paths) == comparable(readme_run_lines(), {})


def test_the_readme_states_the_default_runs_time_and_step_times(default_run):
    """The README's prose says how long the run takes here and what a step takes: the figures shown in its block."""
    readme = (REPO_ROOT / "README.md").read_text()
    shown = readme_run_lines()
    steps = [float(match[1]) for line in shown if (match := re.search(r"\| time ([\d.]+)s$", line))]
    stated = re.search(r"(\d+(?:\.\d+)?)-(\d+(?:\.\d+)?) s a step", readme)
    assert stated, "the README states no step time"
    assert (float(stated[1]), float(stated[2])) == (min(steps), max(steps))
