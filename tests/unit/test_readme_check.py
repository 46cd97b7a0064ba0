"""bench/readme_check.py on recorded runs of `bash examples/run_search_grpo.sh` from two CPUs (tests/unit/data/) and on
READMEs with their block edited: runs of the same code agree on any CPU, an edited README does not."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.readme_check import check, readme_block
from tests.constants import REPO_ROOT

RECORDED = sorted((Path(__file__).parent / "data").glob("default_run_*.log"))
README = (REPO_ROOT / "README.md").read_text()


def test_two_cpus_runs_are_recorded():
    assert len(RECORDED) >= 2, RECORDED


@pytest.mark.parametrize("log", RECORDED, ids=lambda path: path.stem)
def test_a_recorded_run_of_either_cpu_agrees_with_the_readme(log):
    assert check(log.read_text(), README) is None


def test_the_readme_block_as_a_run_agrees_with_itself():
    assert check("\n".join(readme_block(README)), README) is None


def edited(old: str, new: str, count: int = 1) -> str:
    """The README with its block's `old` replaced by `new` (`count` times)."""
    block = "\n".join(readme_block(README))
    assert block.count(old) >= count, old
    return README.replace(block, block.replace(old, new, count))


AMD = next(log for log in RECORDED if "amd_epyc_avx2" in log.name).read_text()


@pytest.mark.parametrize(("old", "new", "named"), [
    ("step 6/30 |", "step 7/30 |", "figure 1: 6 where the README shows 7"),  # the steps the code prints
    ("step 30/30", "step 30/31", "figure 2: 30 where the README shows 31"),
    ("| reward 0.131 | EM 0.000 | turns 1.78", "| score 0.131 | EM 0.000 | turns 1.78", "line 9 reads"),  # words
    ("| EM 0.000 | turns 2.16", "| EM 0.125 | turns 2.16", "EM 0.125 outside [0, 0]"),  # the claims, on the README
    ("reward 0.127 -> 0.181", "reward 0.181 -> 0.127", "is not above the first steps'"),
    ("invalid calls 0.18 -> 0.13", "invalid calls 0.13 -> 0.18", "did not fall"),
    ("final reward 0.184", "final reward 0.194", "is not the last step's 0.184"),
    ("60 steps over 160", "50 steps over 160", "figure 1: 60 where the README shows 50"),
    ("max |diff| 2.20e-04", "max |diff| 2.20e-03", "is not under 0.001"),
    ("tools 786.5", "tools 486.5", "outside the band"),
])
def test_an_edited_readme_is_refused_naming_the_line_and_figure(old, new, named):
    problem = check(AMD, edited(old, new))
    assert problem is not None and named in problem, problem


def test_a_readme_with_a_step_line_left_out_is_refused():
    line = next(line for line in readme_block(README) if line.startswith("step 9/30"))
    problem = check(AMD, README.replace(line + "\n", ""))
    assert problem is not None and "the run printed 27 lines where the README shows 26" in problem, problem


def test_a_run_that_does_not_learn_is_refused():
    flat = AMD.replace("reward 0.118 -> 0.184", "reward 0.184 -> 0.118")
    assert "the run: the reward of the last steps 0.118 is not above the first steps' 0.184" in check(flat, README)
    answered = AMD.replace("| EM 0.000 | turns 1.88", "| EM 0.031 | turns 1.88")
    assert "the run: EM 0.031 outside [0, 0]" in check(answered, README)


def test_the_bench_exits_1_naming_the_disagreement_and_0_on_agreement(tmp_path):
    bad = tmp_path / "bad.log"
    bad.write_text(AMD.replace("step 12/30 |", "step 13/30 |"))
    command = [sys.executable, "bench/default_run.py", "--check-readme"]
    refused = subprocess.run([*command, str(bad)], cwd=REPO_ROOT, capture_output=True, text=True)
    assert refused.returncode == 1 and "line 11, figure 1: 13 where the README shows 12" in refused.stdout, refused
    agreed = subprocess.run([*command, str(RECORDED[0])], cwd=REPO_ROOT, capture_output=True, text=True)
    assert agreed.returncode == 0 and "agrees with" in agreed.stdout, agreed


def test_the_readme_states_step_times_that_hold_its_blocks():
    """The README's prose gives the step times over the CPUs measured: its block's (one CPU's run) lie within them."""
    steps = [float(match[1]) for line in readme_block(README) if (match := re.search(r"\| time ([\d.]+)s$", line))]
    stated = re.search(r"(\d+(?:\.\d+)?)-(\d+(?:\.\d+)?) s a step", README)
    assert stated and steps, "the README states no step time"
    assert float(stated[1]) <= min(steps) and max(steps) <= float(stated[2]), (stated[0], steps)
