"""The README shows what the default run prints today: the suite's default run (conftest's `default_run`, the README's
command) agrees with the README's block as bench/readme_check.py defines it, the check a user runs on their own run
(`bench/default_run.py --check-readme LOG`): the same words on every line, the code's own figures equal, and the
learning the README claims (reward up, invalid calls down, EM 0, the logprob gap under its limit, the tool calls in
the band the bench measured) true of the run. A run's sample path depends on the CPU, so its step-by-step figures are
not compared with the README's (tests/unit/test_readme_check.py checks the check on two CPUs' runs)."""

from __future__ import annotations

import re

from bench.readme_check import NAMED, check, words
from tests.constants import REPO_ROOT


def test_the_readme_shows_the_lines_the_default_run_prints(default_run):
    _, result, _ = default_run
    problem = check(result.stdout + result.stderr, (REPO_ROOT / "README.md").read_text())
    assert problem is None, problem


def test_the_figures_compared_are_each_lines_own():
    """The check reads every measured figure of a step line by its name (a figure it did not read is not checked)."""
    line = ("step 1/30 | reward 0.097 | EM 0.000 | turns 2.03 | calls 1.19 | invalid 0.25 | len 29 | loss +0.2304 | "
            "mismatch 2.1e-04 | time 3.8s")
    assert dict(NAMED.findall(line)) == {"reward": "0.097", "EM": "0.000", "turns": "2.03", "calls": "1.19",
                                         "invalid": "0.25", "len": "29", "loss": "+0.2304", "mismatch": "2.1e-04"}
    assert words(line) == ("step #/# | reward # | EM # | turns # | calls # | invalid # | len # | loss # | "
                           "mismatch # | time #s")


def test_the_default_runs_start_up_line_counts_from_the_trainings_own_start(default_run):
    """The script exec's `rlsearch train` after its SFT warm start, in the same process: the start-up line counts from
    rlsearch's start, not the process's (which counted the warm start in "the rest": 74 of a quiet run's 93 s)."""
    terminal = default_run[1].stdout
    warm_start = float(re.search(r"^\[rlsearch\] warm start: .* in (\d+) s, loss", terminal, re.MULTILINE)[1])
    started = re.search(r"^\[rlsearch\] started in ([\d.]+) s: .*, the rest \(imports, data, checks\) ([\d.]+)$",
                        terminal, re.MULTILINE)
    assert started, terminal[:3000]
    assert float(started[2]) < warm_start / 2, started[0]
